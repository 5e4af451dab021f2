# The prime_math scorer of the reward bridge (verl's data sources numina_aops_forum,
# numina_synthetic_math, numina_amc_aime, numina_synthetic_amc, numina_cn_k12, numina_olympiads):
# verl's own `verl.utils.reward_score.prime_math.compute_score`, run unchanged, scored as verl's
# `default_compute_score` scores it (1.0 when its first result, is_correct, is true, else 0.0).
#
# Needs the PyPI package verl, installed without its dependencies (`pip install --no-deps verl`),
# plus sympy, pylatexenc and numpy (scripts/reward-env installs them). verl's package
# `__init__` imports torch, ray and more, so it is not run: the packages above the scorer are
# entered by path, and `verl.utils.metric` (torch, needed only by a function the scorer never
# calls) is replaced by a module holding an empty `Metric` class.
import importlib
import importlib.util
import os
import sys
import types


def _load_prime_math():
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "prime_math runs verl's own scorer: `pip install --no-deps verl==0.9.1 sympy pylatexenc numpy` "
            "into the environment of reward.python (scripts/reward-env does)"
        )
    root = list(spec.submodule_search_locations)[0]
    for name, path in [
        ("verl", root),
        ("verl.utils", os.path.join(root, "utils")),
        ("verl.utils.reward_score", os.path.join(root, "utils", "reward_score")),
    ]:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [path]
            package.__package__ = name
            sys.modules[name] = package
    if "verl.utils.metric" not in sys.modules:
        metric = types.ModuleType("verl.utils.metric")
        metric.Metric = type("Metric", (), {})
        sys.modules["verl.utils.metric"] = metric
    return importlib.import_module("verl.utils.reward_score.prime_math")


_prime_math = _load_prime_math()


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    is_correct, _format_correctness, _extracted = _prime_math.compute_score(solution_str, ground_truth)
    return float(is_correct)
