"""Graph passes on onnx-graphsurgeon graphs. Each is a small named function `pass(graph) -> graph` that can
run alone; `PASSES` lists them in the default order. Fusions match only exact patterns (constants checked)
and leave everything else alone."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ..dtypes import cast

# Ops that need a newer opset than the exporter's 19: Gelu (20), RMSNormalization (23).
FUSED_OPSET = 23
FOLD_LIMIT_BYTES = 1 << 20
gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR


def linked(t) -> bool:
    """A constant whose bytes stay in the checkpoint (a zero-copy link, never loaded): passes read its name,
    shape and dtype, never its values; rewrites of it are graph operations that TensorRT folds at build time."""
    return isinstance(t, gs.Constant) and isinstance(t._values, gs.ir.tensor.LazyValues) \
        and t._values.tensor.data_location == onnx.TensorProto.EXTERNAL


def _np_dtype(dtype):
    """gs keeps some dtypes as ONNX enums (bf16 variables): the numpy / ml_dtypes equivalent."""
    if dtype is None:
        return np.dtype(np.float32)
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype)) if isinstance(dtype, int) else np.dtype(dtype)


def _rel_eps(t) -> float:
    """Relative rounding of the constant's dtype: a bf16 graph holds 0.044715 as 0.044677734."""
    name = str(_np_dtype(t.dtype))
    return {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}.get(name, 0.0)


def _const(t, value=None, tol=1e-6) -> bool:
    if not isinstance(t, gs.Constant):
        return False
    if value is None:
        return True
    if linked(t) or int(np.prod(t.shape)) != 1:
        return False
    v = np.asarray(t.values, dtype=np.float64)
    return abs(float(v.reshape(-1)[0]) - value) <= max(tol, _rel_eps(t)) * max(1.0, abs(value))


def _only_consumer(t):
    return t.outputs[0] if len(t.outputs) == 1 else None


def _other(node, t):
    """The input of a binary node that is not `t` (None if `t` is not one of exactly two inputs)."""
    ins = list(node.inputs)
    if len(ins) != 2 or t not in ins:
        return None
    return ins[1] if ins[0] is t else ins[0]


def _bump_opset(graph: gs.Graph, opset: int) -> None:
    """Raise the default-domain opset (ops used by the exported graphs kept their semantics from 19 to 23)."""
    if graph.opset < opset:
        graph.opset = opset
        for d in graph.import_domains or []:
            if d.domain in ("", "ai.onnx"):
                d.version = opset


def cleanup(graph: gs.Graph) -> gs.Graph:
    """Remove dead nodes and unused tensors; sort topologically."""
    return graph.cleanup().toposort()


_LAYOUT_OPS = ("Transpose", "Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity")


def fold_weight_transforms(graph: gs.Graph) -> int:
    """Fold layout and dtype ops applied to a weight (a linear weight's Transpose, a Cast), whatever its size,
    and record each result's recipe in the weight map. Returns how many were folded."""
    from ..core import weightmap

    count, changed = 0, True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if node.op not in _LAYOUT_OPS or not node.inputs or not isinstance(node.inputs[0], gs.Constant) \
                    or linked(node.inputs[0]):
                continue
            if any(not isinstance(t, gs.Constant) for t in node.inputs[1:]) or len(node.outputs) != 1:
                continue
            src, out = node.inputs[0], node.outputs[0]
            x = np.asarray(src.values)
            if node.op == "Transpose":
                perm = list(node.attrs.get("perm", range(x.ndim)[::-1]))
                value, op = np.transpose(x, perm), {"op": "transpose", "perm": perm}
            elif node.op == "Cast":
                to = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"]))
                value, op = cast(x, str(to)), {"op": "cast", "to": str(to)}
            else:
                if node.op == "Reshape":
                    shape = [int(v) for v in np.asarray(node.inputs[1].values).reshape(-1)]
                    if node.attrs.get("allowzero", 0) == 0:
                        shape = [x.shape[i] if v == 0 else v for i, v in enumerate(shape)]
                    value = x.reshape(shape)
                elif node.op == "Unsqueeze":
                    value = np.expand_dims(x, tuple(int(a) for a in np.asarray(node.inputs[1].values).reshape(-1)))
                elif node.op == "Squeeze":
                    axes = node.inputs[1].values if len(node.inputs) > 1 else None
                    value = np.squeeze(x, None if axes is None else tuple(int(a) for a in np.asarray(axes).reshape(-1)))
                else:
                    value = x
                op = {"op": "reshape", "shape": list(value.shape)}
            out.to_constant(np.ascontiguousarray(value))
            node.outputs = []
            weightmap.derive(out.name, op, src.name)
            count, changed = count + 1, True
        graph.cleanup()
    return count


_ELEMENTWISE = {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Neg": np.negative, "Exp": np.exp, "Log": np.log,
                "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power}


def fold_low_precision_constants(graph: gs.Graph) -> int:
    """Elementwise ops on small bf16/fp16 constants (a bf16 graph's attention scale 1/sqrt(d)), which ONNX
    Runtime's CPU kernels cannot fold: computed in fp32 and rounded to the output's dtype, as PyTorch does."""
    count = 0
    for node in list(graph.nodes):
        fn = _ELEMENTWISE.get(node.op)
        ins = node.inputs
        if fn is None or not ins or len(node.outputs) != 1 or not all(_const(t) and not linked(t) for t in ins):
            continue
        dtypes = {np.asarray(t.values).dtype for t in ins}
        if len(dtypes) != 1 or str(next(iter(dtypes))) not in ("bfloat16", "float16") \
                or max(np.asarray(t.values).nbytes for t in ins) > FOLD_LIMIT_BYTES:
            continue
        dt = next(iter(dtypes))
        value = fn(*[np.asarray(t.values, dtype=np.float32) for t in ins]).astype(dt)
        node.outputs[0].to_constant(np.ascontiguousarray(value))
        node.outputs = []
        count += 1
    graph.cleanup()
    return count


def fold_constants(graph: gs.Graph) -> gs.Graph:
    """Evaluate every subgraph that depends only on constants (shape arithmetic, weight transposes)."""
    from ..core import weightmap

    fold_weight_transforms(graph)
    fold_low_precision_constants(graph)

    def reads_weight(node) -> bool:
        """Anything else computed from a weight stays in the graph (TensorRT folds it at build time), so
        every constant that depends on the checkpoint has a recipe in the weight map."""
        return any(isinstance(t, gs.Constant) and (linked(t) or weightmap.recipe_of(t.name) is not None)
                   for t in node.inputs)

    # the size limit keeps e.g. T5's position bias ([1, heads, T, T]) computed, not stored
    return graph.fold_constants(error_ok=False, size_threshold=FOLD_LIMIT_BYTES,
                                should_exclude_node=reads_weight).cleanup().toposort()


def infer_shapes(graph: gs.Graph) -> gs.Graph:
    """ONNX shape inference (on disk for models over 2 GB), so fusions can read ranks."""
    import onnx

    model = gs.export_onnx(graph)
    if model.ByteSize() < 2_000_000_000:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    else:
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            src, dst = os.path.join(d, "in.onnx"), os.path.join(d, "out.onnx")
            onnx.save(model, src, save_as_external_data=True)
            onnx.shape_inference.infer_shapes_path(src, dst)
            inferred = onnx.load(dst)
    return gs.import_onnx(inferred)


def _projection_weight(mm):
    """(weight constant, stored [N, K]) for a MatMul over a linear weight: a [K, N] constant, or a zero-copy
    link stored [N, K] read through its own Transpose(perm=[1, 0]). None otherwise."""
    b = mm.inputs[1]
    if _const(b) and not linked(b) and len(b.shape) == 2:
        return b, False
    tr = b.inputs[0] if b.inputs else None
    if tr is not None and tr.op == "Transpose" and list(tr.attrs.get("perm", [1, 0])) == [1, 0] \
            and linked(tr.inputs[0]) and len(tr.inputs[0].shape) == 2 and len(b.outputs) == 1:
        return tr.inputs[0], True
    return None


def _concat(name: str, parts: list, axis: int, graph: gs.Graph, new_nodes: list):
    """parts joined along `axis`: new bytes for loaded constants (recorded in the weight map), a Concat node
    that TensorRT folds at build time when any part is a zero-copy link."""
    from ..core import weightmap

    if not any(linked(t) for t in parts):
        out = gs.Constant(name, np.concatenate([t.values for t in parts], axis))
        weightmap.derive(name, {"op": "concat", "axis": axis}, *[t.name for t in parts])
        return out
    out = gs.Variable(name, dtype=parts[0].dtype)
    new_nodes.append(gs.Node("Concat", f"{name}_concat", attrs={"axis": axis}, inputs=list(parts), outputs=[out]))
    return out


def fuse_projections(graph: gs.Graph) -> gs.Graph:
    """MatMuls that read the same activation with constant linear weights (q/k/v projections, and the
    single-stream block's q/k/v/mlp projections) become one MatMul over concatenated weights, one bias Add
    (when every branch has a constant bias), and a Split back into the original tensors. Zero-copy links
    ([N, K] in the checkpoint) are joined as Transpose(Concat(W_i, axis 0)): no weight bytes are written."""
    groups = defaultdict(list)
    for n in graph.nodes:
        if n.op == "MatMul" and not isinstance(n.inputs[0], gs.Constant) and _projection_weight(n) is not None:
            groups[n.inputs[0].name].append(n)
    count = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        weights = [_projection_weight(n) for n in nodes]
        kinds = {(str(_np_dtype(w.dtype)), stored_nk, w.shape[1] if stored_nk else w.shape[0]) for w, stored_nk in weights}
        if len(kinds) != 1:
            continue
        stored_nk = weights[0][1]
        sizes = [int(w.shape[0] if stored_nk else w.shape[1]) for w, _ in weights]
        biases = []
        for n, size in zip(nodes, sizes):
            add = _only_consumer(n.outputs[0])
            b = _other(add, n.outputs[0]) if add is not None and add.op == "Add" else None
            biases.append((add, b) if _const(b) and len(b.shape) == 1 and b.shape[0] == size else None)
        with_bias = all(biases)
        x, tag, new_nodes = nodes[0].inputs[0], f"{count}_{nodes[0].name}", []
        weight = _concat(f"fused_w_{tag}", [w for w, _ in weights], 0 if stored_nk else 1, graph, new_nodes)
        if stored_nk:
            joined, weight = weight, gs.Variable(f"fused_wt_{tag}", dtype=weight.dtype)
            new_nodes.append(gs.Node("Transpose", f"fused_transpose_{tag}", attrs={"perm": [1, 0]}, inputs=[joined],
                                     outputs=[weight]))
        mm_out = gs.Variable(f"fused_mm_{tag}", dtype=nodes[0].outputs[0].dtype)
        new_nodes.append(gs.Node("MatMul", f"fused_matmul_{count}", inputs=[x, weight], outputs=[mm_out]))
        split_in = mm_out
        if with_bias:
            bias = _concat(f"fused_b_{tag}", [b for _, b in biases], 0, graph, new_nodes)
            split_in = gs.Variable(f"fused_add_{tag}", dtype=mm_out.dtype)
            new_nodes.append(gs.Node("Add", f"fused_bias_{count}", inputs=[mm_out, bias], outputs=[split_in]))
        targets = [add.outputs[0] for add, _ in biases] if with_bias else [n.outputs[0] for n in nodes]
        for n in nodes:
            n.outputs = []
        for add, _ in (biases if with_bias else []):
            add.outputs = []
        split_sizes = gs.Constant(f"fused_sizes_{tag}", np.array(sizes, dtype=np.int64))
        new_nodes.append(gs.Node("Split", f"fused_split_{count}", attrs={"axis": -1},
                                 inputs=[split_in, split_sizes], outputs=targets))
        graph.nodes.extend(new_nodes)
        count += 1
    return graph.cleanup().toposort()


def fuse_rmsnorm(graph: gs.Graph) -> gs.Graph:
    """x * 1/sqrt(mean(x^2, last axis) + eps) [* w]  ->  RMSNormalization(x, w, axis=-1, epsilon=eps)."""
    count = 0
    for pow_node in [n for n in graph.nodes if n.op == "Pow"]:
        x = pow_node.inputs[0]
        if not _const(pow_node.inputs[1], 2.0) or isinstance(x, gs.Constant):
            continue
        mean = _only_consumer(pow_node.outputs[0])
        if mean is None or mean.op != "ReduceMean" or len(mean.inputs) != 2 or not _const(mean.inputs[1]):
            continue
        axes = np.asarray(mean.inputs[1].values).reshape(-1)
        rank = len(x.shape) if x.shape is not None else None
        if mean.attrs.get("keepdims", 1) != 1 or len(axes) != 1 or not (axes[0] == -1 or (rank and axes[0] == rank - 1)):
            continue
        add = _only_consumer(mean.outputs[0])
        eps = _other(add, mean.outputs[0]) if add is not None and add.op == "Add" else None
        if not _const(eps) or eps.values.size != 1:
            continue
        sqrt = _only_consumer(add.outputs[0])
        rec = _only_consumer(sqrt.outputs[0]) if sqrt is not None and sqrt.op == "Sqrt" else None
        mul = _only_consumer(rec.outputs[0]) if rec is not None and rec.op == "Reciprocal" else None
        if mul is None or mul.op != "Mul" or _other(mul, rec.outputs[0]) is not x:
            continue
        out, scale = mul.outputs[0], None
        wmul = _only_consumer(out)
        w = _other(wmul, out) if wmul is not None and wmul.op == "Mul" else None
        last = x.shape[-1] if x.shape else None
        if _const(w) and w.values.ndim == 1 and (last is None or not isinstance(last, int) or w.values.shape[0] == last):
            scale, out = w, wmul.outputs[0]
            wmul.outputs = []
        if scale is None:
            if not isinstance(last, int):
                continue
            scale = gs.Constant(f"rms_ones_{count}", np.ones(last, dtype=eps.values.dtype))
        elif scale.values.dtype != np.asarray(eps.values).dtype and x.dtype is not None and scale.values.dtype != x.dtype:
            continue  # the weight multiply changes dtype: not the plain pattern
        mul.outputs = []
        graph.nodes.append(gs.Node("RMSNormalization", f"rmsnorm_{count}", inputs=[x, scale], outputs=[out],
                                   attrs={"axis": -1, "epsilon": float(np.asarray(eps.values).reshape(-1)[0])}))
        count += 1
    if count:
        _bump_opset(graph, FUSED_OPSET)
    return graph.cleanup().toposort()


def fuse_gelu_tanh(graph: gs.Graph) -> gs.Graph:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))  ->  Gelu(x, approximate="tanh")."""
    count = 0
    for tanh in [n for n in graph.nodes if n.op == "Tanh"]:
        inner = tanh.inputs[0].inputs[0] if tanh.inputs[0].inputs else None
        if inner is None or inner.op != "Mul":
            continue
        c = next((i for i in inner.inputs if _const(i, 0.7978845608, 1e-5)), None)
        s = _other(inner, c) if c is not None else None
        add = s.inputs[0] if s is not None and s.inputs else None
        if add is None or add.op != "Add":
            continue
        x = None
        for a, b in (add.inputs, add.inputs[::-1]):
            p = b.inputs[0] if b.inputs else None
            if p is not None and p.op == "Mul":
                k = next((i for i in p.inputs if _const(i, 0.044715, 1e-4)), None)
                pw = _other(p, k).inputs[0] if k is not None and _other(p, k).inputs else None
                if pw is not None and pw.op == "Pow" and pw.inputs[0] is a and _const(pw.inputs[1], 3.0):
                    x = a
        if x is None:
            continue
        plus = _only_consumer(tanh.outputs[0])
        if plus is None or plus.op != "Add" or not _const(_other(plus, tanh.outputs[0]), 1.0):
            continue
        # follow the multiplies after (1 + tanh): constants must multiply to 0.5 and x must appear once
        t, factor, seen_x, last = plus.outputs[0], 1.0, False, None
        for _ in range(2):
            m = _only_consumer(t)
            if m is None or m.op != "Mul":
                break
            o = _other(m, t)
            if _const(o) and o.values.size == 1:
                factor *= float(np.asarray(o.values).reshape(-1)[0])
            elif o is x and not seen_x:
                seen_x = True
            elif o is not None and o.inputs and o.inputs[0].op == "Mul" and x in o.inputs[0].inputs \
                    and not seen_x and _const(_other(o.inputs[0], x)):
                seen_x, factor = True, factor * float(np.asarray(_other(o.inputs[0], x).values).reshape(-1)[0])
            else:
                break
            t, last = m.outputs[0], m
            if seen_x and abs(factor - 0.5) < 1e-6:
                break
        if last is None or not seen_x or abs(factor - 0.5) > 1e-6:
            continue
        out = last.outputs[0]
        last.outputs = []
        graph.nodes.append(gs.Node("Gelu", f"gelu_tanh_{count}", attrs={"approximate": "tanh"}, inputs=[x],
                                   outputs=[out]))
        count += 1
    if count:
        _bump_opset(graph, FUSED_OPSET)
    return graph.cleanup().toposort()


def _ints(t) -> list[int] | None:
    return [int(v) for v in np.asarray(t.values).reshape(-1)] if _const(t) else None


def _last_pair_slice(squeeze, start: int):
    """X if `squeeze` is Squeeze(Slice(X, [start], [start+1], [-1]), [-1]) over a last axis of size 2."""
    if squeeze is None or squeeze.op != "Squeeze" or _ints(squeeze.inputs[1]) != [-1]:
        return None
    sl = squeeze.inputs[0].inputs[0] if squeeze.inputs[0].inputs else None
    if sl is None or sl.op != "Slice" or len(sl.inputs) < 4:
        return None
    steps = _ints(sl.inputs[4]) if len(sl.inputs) > 4 else [1]
    x = sl.inputs[0]
    if (_ints(sl.inputs[1]), _ints(sl.inputs[2]), _ints(sl.inputs[3]), steps) != ([start], [start + 1], [-1], [1]):
        return None
    if x.shape is None or x.shape[-1] != 2:
        return None
    return x


def simplify_rotary(graph: gs.Graph) -> gs.Graph:
    """FLUX's rotary embedding rotates channel pairs: stack([-x_imag, x_real], -1) built from two Slices,
    two Squeezes, a Neg, two Unsqueezes and a Concat over X = x.view(..., D/2, 2). Replace the eight nodes
    by Gather(X, [1, 0], axis=-1) * [-1, 1]."""
    count = 0
    for concat in [n for n in graph.nodes if n.op == "Concat" and n.attrs.get("axis") == -1 and len(n.inputs) == 2]:
        first, second = (t.inputs[0] if t.inputs else None for t in concat.inputs)
        if first is None or second is None or first.op != "Unsqueeze" or second.op != "Unsqueeze":
            continue
        if _ints(first.inputs[1]) != [-1] or _ints(second.inputs[1]) != [-1]:
            continue
        neg = first.inputs[0].inputs[0] if first.inputs[0].inputs else None
        if neg is None or neg.op != "Neg":
            continue
        x_imag = _last_pair_slice(neg.inputs[0].inputs[0] if neg.inputs[0].inputs else None, 1)
        x_real = _last_pair_slice(second.inputs[0].inputs[0] if second.inputs[0].inputs else None, 0)
        if x_imag is None or x_imag is not x_real:
            continue
        dtype = _np_dtype(x_imag.dtype)
        swapped = gs.Variable(f"rotary_swap_{count}", dtype=x_imag.dtype)
        out = concat.outputs[0]
        concat.outputs = []
        graph.nodes.append(gs.Node("Gather", f"rotary_gather_{count}", attrs={"axis": -1},
                                   inputs=[x_imag, gs.Constant(f"rotary_idx_{count}", np.array([1, 0], np.int64))],
                                   outputs=[swapped]))
        graph.nodes.append(gs.Node("Mul", f"rotary_sign_{count}", outputs=[out], inputs=[
            swapped, gs.Constant(f"rotary_signs_{count}", np.array([-1.0, 1.0], dtype=dtype))]))
        count += 1
    return graph.cleanup().toposort()


def _sole(t, op: str):
    n = _only_consumer(t)
    return n if n is not None and n.op == op and len(t.outputs) == 1 else None


def share_rotary_casts(graph: gs.Graph) -> gs.Graph:
    """A bf16 graph (PyTorch's own trace) applies rotary embeddings in fp32: Cast(x) * cos + Cast(rot(x)) * sin,
    where rot (Reshape, Gather of the channel pairs, Mul by [-1, 1], Reshape; simplify_rotary's form) is exact
    in any float dtype. Rotate the fp32 Cast(x) that is already there instead: one Cast less per rotary, the
    same numbers bit for bit."""
    count = 0
    for gather in [n for n in graph.nodes if n.op == "Gather" and n.attrs.get("axis") == -1]:
        if _ints(gather.inputs[1]) != [1, 0] or not gather.inputs[0].inputs:
            continue
        first = gather.inputs[0].inputs[0]
        sign = _sole(gather.outputs[0], "Mul")
        signs = _other(sign, gather.outputs[0]) if sign is not None else None
        last = _sole(sign.outputs[0], "Reshape") if _const(signs) and not linked(signs) else None
        cast = _sole(last.outputs[0], "Cast") if last is not None else None
        if first.op != "Reshape" or cast is None or sorted(np.asarray(signs.values, np.float32).tolist()) != [-1.0, 1.0]:
            continue
        x = first.inputs[0]
        to = cast.attrs.get("to")
        wide = next((c for c in x.outputs if c.op == "Cast" and c is not cast and c.attrs.get("to") == to), None)
        if wide is None:
            continue
        to = _np_dtype(cast.attrs["to"])
        first.inputs[0] = wide.outputs[0]
        sign.inputs = [gather.outputs[0], gs.Constant(f"{signs.name}_{to}", np.asarray(signs.values).astype(to))]
        for t in (first.outputs[0], gather.outputs[0], sign.outputs[0]):
            t.dtype = to
        last.outputs = [cast.outputs[0]]
        cast.outputs = []
        count += 1
    return graph.cleanup().toposort()


def _scale_mul(t):
    """(Mul node, its scalar constant, the other input) when `t` is Mul(x, scalar constant), else None."""
    if len(t.inputs) != 1 or t.inputs[0].op != "Mul":
        return None
    mul = t.inputs[0]
    consts = [i for i in mul.inputs if _const(i) and not linked(i) and int(np.prod(i.shape)) == 1]
    if len(mul.inputs) != 2 or len(consts) != 1:
        return None
    return mul, consts[0], _other(mul, consts[0])


def exact_attention_scale(graph: gs.Graph) -> gs.Graph:
    """Attention's softmax scale as exact as the graph's dtype allows. The exporter writes SDPA as
    softmax(Mul(q, c) @ Mul(k^T, c)) with c = sqrt(1/sqrt(d)) in q's dtype: in bf16, for FLUX's d = 128, c is
    0.296875 instead of 0.297302, so every logit is scaled by c^2 = 0.99714 of PyTorch's (fp16: 1.00041). Here
    q's side takes the nearest power of two (exact in any dtype) and k's side the rest, rounded once: the
    product is off by at most half a unit of the last place (d = 128: 1.1e-4 in bf16 and fp16; exact for d = 16
    or 64). On an fp32 graph the same split is written in fp32, so that precision placement rounds only k's side.
    Scales other than the default 1/sqrt(d) are left alone. Needs q's last dim (infer_shapes first)."""
    for soft in [n for n in graph.nodes if n.op == "Softmax"]:
        mm = soft.inputs[0].inputs[0] if soft.inputs[0].inputs else None
        while mm is not None and mm.op == "Add":  # an attention mask or position bias added to the logits
            mm = next((i.inputs[0] for i in mm.inputs if i.inputs and i.inputs[0].op in ("MatMul", "Add")), None)
        if mm is None or mm.op != "MatMul" or len(mm.inputs) != 2:
            continue
        q_side, k_side = _scale_mul(mm.inputs[0]), _scale_mul(mm.inputs[1])
        if q_side is None or k_side is None:
            continue
        d = (q_side[2].shape or [None])[-1]
        if not isinstance(d, (int, np.integer)) or d <= 0:
            continue
        scale = 1.0 / np.sqrt(float(d))
        root = np.sqrt(scale)
        dt = np.asarray(q_side[1].values).dtype
        if not all(_const(c, root, tol=1e-7) for _, c, _ in (q_side, k_side)):
            continue
        p = 2.0 ** np.round(np.log2(root))
        q_val = np.full(q_side[1].shape, p, dtype=np.float64).astype(dt)
        k_val = np.full(k_side[1].shape, scale / p, dtype=np.float64).astype(dt)
        if np.array_equal(np.asarray(q_side[1].values), q_val) and np.array_equal(np.asarray(k_side[1].values), k_val):
            continue  # already split so (e.g. d = 16 or 64: both factors powers of two)
        for (mul, c, _), val, tag in ((q_side, q_val, "q"), (k_side, k_val, "k")):
            mul.inputs[list(mul.inputs).index(c)] = gs.Constant(f"{c.name}_exact_{tag}", np.ascontiguousarray(val))
    graph.cleanup()
    return graph


PASSES = {
    "cleanup": cleanup,
    "fold_constants": fold_constants,
    "infer_shapes": infer_shapes,
    "fuse_projections": fuse_projections,
    "fuse_rmsnorm": fuse_rmsnorm,
    "fuse_gelu_tanh": fuse_gelu_tanh,
    "simplify_rotary": simplify_rotary,
    "share_rotary_casts": share_rotary_casts,
    "exact_attention_scale": exact_attention_scale,
}
DEFAULT_PASSES = ("cleanup", "fold_constants", "infer_shapes", "fuse_projections", "fuse_rmsnorm",
                  "fuse_gelu_tanh", "simplify_rotary", "share_rotary_casts", "exact_attention_scale", "cleanup")
