"""errors.py: every error a user can fix is a FluxtrtError (the CLI's one line, exit 2); HTTP errors carry their
status."""

import inspect

from fluxtrt import errors


def test_every_error_is_a_fluxtrt_error_and_http_ones_carry_a_status():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) >= 15
    assert all(issubclass(c, errors.FluxtrtError) for c in classes)
    assert errors.BadRequest("x").status == 400 and errors.TooLarge("x").status == 413
    assert issubclass(errors.QueueFull, errors.RequestError) and issubclass(errors.ShuttingDown, errors.RequestError)
