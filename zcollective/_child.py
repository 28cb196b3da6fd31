"""Entry point of one replica process started by :mod:`zcollective.testing`."""

from __future__ import annotations

import sys
import traceback


def main(payload: str, result: str) -> int:
    import faulthandler
    import signal

    import cloudpickle

    if hasattr(signal, "SIGUSR2"):  # a replica that overran shows where every thread was
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # (a C handler: never deferred)

    with open(payload, "rb") as f:
        paths = cloudpickle.load(f)
        sys.path[:0] = [p for p in paths if p not in sys.path]
        fn, args, kwargs, initialize, init_timeout = cloudpickle.load(f)

    import zcollective

    code = 0
    try:
        if initialize:
            zcollective.initialize(timeout=init_timeout)
        value = fn(*args, **kwargs)
        if initialize and zcollective.is_initialized():
            zcollective.teardown()
        outcome = ("ok", value, "")
    except BaseException as exc:
        code = 1
        tb = traceback.format_exc()
        try:
            cloudpickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        outcome = ("error", exc, tb)
    try:
        data = cloudpickle.dumps(outcome)
    except Exception as exc:
        data = cloudpickle.dumps(("error", RuntimeError(f"cannot pickle the return value: {exc}"), ""))
        code = 1
    with open(result, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
