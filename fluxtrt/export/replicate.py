"""Block replication for zero-copy export: trace a transformer with only three blocks of each repeated kind
(first, middle, last) and grow the traced graph to the model's real depth by copying the middle block.

The FLUX transformer is 19 double-stream and 38 single-stream blocks of identical structure. Tracing and
optimizing all 57 costs minutes (the ONNX optimizer is superlinear in graph size); tracing 3 + 3 costs
seconds, and the middle block's subgraph is exactly what every block between the first and the last turns
into. The first block differs (it computes values the others reuse: SiLU(temb), rotary tables, shape
tensors) and so may the last (the final single block drops the text half), which is why both are traced.
T5's encoder blocks follow the same pattern (block 0 computes the relative position bias the others share).
Each ComponentSpec names its repeated blocks (`repeated_blocks`: module list, config key of its depth).

How a block is found: the dynamo exporter records each node's module scope (`pkg.torch.onnx.name_scopes`,
e.g. `model.transformer_blocks.1`); nodes the optimizer added without a scope (Split fusions) join the latest
block that feeds them. For the middle block T between the first P and the last L:
- stream in: what T reads from P that L does not read (P's hidden states out) -> the previous copy's stream
  out, matched by dtype and shape (image states [batch, image_tokens, D] vs text [batch, 512, D]);
- shared: everything else T reads (computed once, by P or before the blocks) -> every copy reads it too;
- stream out: what L reads from T -> L then reads it from the last copy.
Any case that does not fit this pattern raises ReplicationError, and export traces the whole model instead.
tests/export/test_replicate.py checks that a replicated graph equals a full trace node for node and output for output."""

from __future__ import annotations

import ast
import re

from ..errors import (
    ReplicationError,  # noqa: F401 - defined in errors.py, raised here
)

TRACED_BLOCKS = 3  # first, middle (the one copied), last
SCOPE_KEY = "pkg.torch.onnx.name_scopes"


def reduced_depths(config: dict, repeated: tuple[tuple[str, str], ...]) -> tuple[dict, dict]:
    """(config overrides that trace TRACED_BLOCKS blocks per family, {family: real depth}) for the families
    deep enough to be worth replicating."""
    overrides, depths = {}, {}
    for family, key in repeated:
        depth = int(config.get(key, 0))
        if depth > TRACED_BLOCKS:
            overrides[key] = TRACED_BLOCKS
            depths[family] = depth
    return overrides, depths


def replicate(ir_model, depths: dict[str, int], scope_prefix: str = "model.") -> int:
    """Grow each family's traced blocks (0, 1, 2) to `depth` blocks in place; returns the nodes added."""
    added = 0
    for family, depth in depths.items():
        added += _grow(ir_model.graph, family, depth, scope_prefix)
    return added


def _scope_block(node, pattern) -> tuple[str, int] | None:
    raw = node.metadata_props.get(SCOPE_KEY)
    if not raw:
        return None
    for scope in ast.literal_eval(raw):
        m = pattern.match(scope)
        if m:
            return m.group(1), int(m.group(2))
    return ("", -1)  # scoped, outside every block


def _assign(graph, family: str, scope_prefix: str) -> dict[int, int]:
    """id(node) -> block index of `family`, for the nodes of that family's blocks."""
    pattern = re.compile(rf"^{re.escape(scope_prefix)}({re.escape(family)})\.(\d+)$")
    block: dict[int, int] = {}
    for node in graph:  # topological order: an unscoped node's producers are already assigned
        found = _scope_block(node, pattern)
        if found is None:
            owners = {block.get(id(v.producer())) for v in node.inputs
                      if v is not None and v.producer() is not None and id(v.producer()) in block}
            if owners:  # the latest block it reads from (it may also read shape values of an earlier one)
                block[id(node)] = max(owners)
        elif found[0] == family:
            block[id(node)] = found[1]
    return block


def _entries(nodes, ids) -> list:
    """Values the block reads from outside itself (initializers and graph inputs excluded), in first-use order."""
    seen, out = set(), []
    for node in nodes:
        for v in node.inputs:
            if v is None or v.is_initializer() or id(v) in seen:
                continue
            p = v.producer()
            if p is None or id(p) not in ids:
                seen.add(id(v))
                out.append(v)
    return out


def _signature(v) -> tuple:
    return (str(v.dtype), str(v.shape))


def _grow(graph, family: str, depth: int, scope_prefix: str) -> int:
    import onnx_ir as ir

    block = _assign(graph, family, scope_prefix)
    nodes = {i: [n for n in graph if block.get(id(n)) == i] for i in range(TRACED_BLOCKS)}
    if sorted(set(block.values())) != list(range(TRACED_BLOCKS)) or not all(nodes.values()):
        raise ReplicationError(f"{family}: expected blocks 0..{TRACED_BLOCKS - 1} in the traced graph, "
                               f"found {sorted(set(block.values()))}")
    middle, last = nodes[1], nodes[2]
    t_ids, l_ids = {id(n) for n in middle}, {id(n) for n in last}
    t_entries, l_entries = _entries(middle, t_ids), _entries(last, l_ids)
    l_entry_ids = {id(v) for v in l_entries}
    # what block 1 reads from block 0 and block 2 does not read is the stream; anything else is shared
    stream_in = [v for v in t_entries if block.get(id(v.producer())) == 0 and id(v) not in l_entry_ids]
    stream_out = [v for v in l_entries if id(v.producer()) in t_ids]
    # everything block 1 hands out must go to block 2 and nowhere else
    for node in middle:
        for out in node.outputs:
            if out.is_graph_output() or any(id(u) not in t_ids | l_ids for u, _ in out.uses()):
                raise ReplicationError(f"{family}.1's output {out.name} is read outside {family}.2")
    pairs = {}
    for v in stream_in:
        match = [o for o in stream_out if _signature(o) == _signature(v)]
        if len(match) != 1:
            raise ReplicationError(f"{family}: cannot pair block input {v.name} {_signature(v)} with one output")
        pairs[id(v)] = match[0]
    if len(pairs) != len(stream_out) or len({id(o) for o in pairs.values()}) != len(stream_out):
        raise ReplicationError(f"{family}: block inputs and outputs do not pair one to one")

    def prefix(i):
        return f"{family}.{i}."

    def weights_of(block_nodes, i):
        found = {}
        for node in block_nodes:
            for v in node.inputs:
                if v is not None and v.is_initializer() and v.name.startswith(prefix(i)):
                    found[id(v)] = v
        return list(found.values())

    for v in weights_of(last, 2):  # the traced last block becomes block depth-1 (frees names for the copies)
        v.name = prefix(depth - 1) + v.name[len(prefix(2)):]
    template_weights = weights_of(middle, 1)
    current = {id(v): pairs[id(v)] for v in stream_in}  # stream input of the next copy
    anchor, added = middle[-1], 0
    for c in range(2, depth - 1):
        vmap = {id(v): current[id(v)] for v in stream_in}
        for w in template_weights:
            copy = ir.Value(name=prefix(c) + w.name[len(prefix(1)):], shape=w.shape, type=w.type,
                            const_value=w.const_value)  # a placeholder: export links or fills it from the checkpoint
            graph.register_initializer(copy)
            vmap[id(w)] = copy
        scope = str(["", scope_prefix.rstrip("."), f"{scope_prefix}{family}.{c}"])
        fresh = []
        for node in middle:
            new = ir.Node(node.domain, node.op_type, [None if v is None else vmap.get(id(v), v) for v in node.inputs],
                          list(node.attributes.values()), overload=node.overload, num_outputs=len(node.outputs),
                          version=node.version, name=f"{node.name}__{family}{c}", metadata_props={SCOPE_KEY: scope})
            for old, out in zip(node.outputs, new.outputs):
                out.name = f"{old.name}__{family}{c}"
                out.dtype = old.dtype
                out.shape = old.shape.copy() if old.shape is not None else None
                vmap[id(old)] = out
            fresh.append(new)
        graph.insert_after(anchor, fresh)
        anchor, added = fresh[-1], added + len(fresh)
        current = {id(v): vmap[id(pairs[id(v)])] for v in stream_in}
    for v in stream_in:  # the last block reads the last copy
        old, new = pairs[id(v)], current[id(v)]
        if new is old:
            continue
        for user, index in list(old.uses()):
            if id(user) in l_ids:
                user.replace_input_with(index, new)
    return added
