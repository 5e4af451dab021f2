# The math-verify scorer of the reward bridge, behaving as verl's
# `verl.utils.reward_score.math_verify.compute_score`: the ground truth is put in \boxed{} and
# parsed as LaTeX, the response is parsed as an expression or as LaTeX, and Hugging Face's
# math-verify decides whether they are equal (1.0) or not (0.0). An error inside math-verify
# scores 0; its own timeout (a BaseException, 5 s by default) scores `timeout_score`.
# Needs the PyPI package math-verify in the interpreter of `reward.python`.
from math_verify.errors import TimeoutException
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

_verify = math_metric(
    gold_extraction_target=(LatexExtractionConfig(),),
    pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, timeout_score=0.0):
    if not isinstance(ground_truth, str):
        raise TypeError(f"math_verify needs a string ground truth, got {type(ground_truth).__name__} {ground_truth!r}")
    try:
        score, _ = _verify(["\\boxed{" + ground_truth + "}"], [solution_str])
    except Exception:
        return 0.0
    except TimeoutException:
        return float(timeout_score)
    return float(score)
