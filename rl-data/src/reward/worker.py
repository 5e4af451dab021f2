# The reward worker: one persistent Python process of the pool in python.rs.
#
#   python -c <this file> FILE FUNCTION KWARGS_JSON
#
# Loads FUNCTION from FILE (a verl `custom_reward_function` file, run unchanged; or, with
# RL_REWARD_SOURCE set, that text under FILE's name: the bridge's own scorers), then answers
# requests on stdin, one JSON line each: {"items": [{"data_source", "solution_str",
# "ground_truth", "extra_info"}, ...]}. Each item is answered by one JSON line as soon as it is
# scored (the pool times every call from the previous answer): {"score": x} for a number or
# bool, {"dict": {...}} for a dict, {"bad": "..."} for any other return, {"error": traceback}
# for an exception. The first line is {"ready": pid}, or {"fatal": message} when FILE or
# FUNCTION cannot be loaded. The user's own prints go to stderr: stdout carries only the
# protocol. No timeout here: the pool kills a worker whose call runs too long (signals would
# clash with the scorers' own, math-verify's SIGALRM for one).
import importlib.util
import json
import math
import os
import sys
import traceback
import types

proto = os.fdopen(os.dup(1), "wb", buffering=0)
os.dup2(2, 1)
sys.stdout = sys.stderr


def send(obj):
    proto.write(json.dumps(obj, allow_nan=False).encode() + b"\n")


def finite(v):
    """`v` with every non-finite float written as a string, so that JSON can carry it."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, dict):
        return {str(k): finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None or isinstance(v, float):
        return v
    item = getattr(v, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return finite(item())
        except Exception:
            pass
    return repr(v)


def die_with_parent():
    """Linux: the kernel kills this worker when the thread that started it ends."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            sys.exit(0)
    except Exception:
        pass


class LoadError(Exception):
    """What is wrong with FILE or FUNCTION itself (no traceback needed)."""


def load(path, name):
    module_name = "reward_" + os.path.splitext(os.path.basename(path))[0]
    source = os.environ.pop("RL_REWARD_SOURCE", None)
    if source is not None:  # one of the bridge's own scorers, compiled into the harness
        module = types.ModuleType(module_name)
        module.__file__ = path
        sys.modules[module_name] = module
        exec(compile(source, path, "exec"), module.__dict__)
    else:
        if not os.path.isfile(path):
            raise LoadError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise LoadError(f"{path} is not a file Python can import")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec.loader.exec_module(module)
    if not hasattr(module, name):
        functions = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise LoadError(f"{path} has no `{name}` (callables there: {', '.join(functions) or 'none'})")
    fn = getattr(module, name)
    if not callable(fn):
        raise LoadError(f"`{name}` in {path} is a {type(fn).__name__}, not a function")
    return fn


def main():
    die_with_parent()
    path, name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        fn = load(path, name)
    except LoadError as e:
        send({"fatal": str(e)})
        sys.exit(3)
    except BaseException:
        send({"fatal": traceback.format_exc()})
        sys.exit(3)
    send({"ready": os.getpid()})
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            return
        for item in json.loads(line)["items"]:
            try:
                r = fn(
                    data_source=item["data_source"],
                    solution_str=item["solution_str"],
                    ground_truth=item["ground_truth"],
                    extra_info=item["extra_info"],
                    **kwargs,
                )
                if isinstance(r, bool) or isinstance(r, (int, float)):
                    out = {"score": finite(float(r))}
                elif isinstance(r, dict):
                    out = {"dict": finite(r)}
                elif hasattr(r, "item") and callable(r.item) and isinstance(finite(r), (int, float)):
                    out = {"score": finite(float(r.item()))}
                else:
                    out = {"bad": f"{type(r).__name__} {r!r:.200}"}
            except Exception:
                out = {"error": traceback.format_exc()}
            send(out)


main()
