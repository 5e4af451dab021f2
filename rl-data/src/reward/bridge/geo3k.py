# The geo3k scorer of the reward bridge (data source `hiyouga/geometry3k`), behaving as verl's
# `verl.utils.reward_score.geo3k.compute_score`: (1 - format_score) * accuracy + format_score *
# format, where format is whether the whole response is <think>...</think> followed by a
# \boxed{...}, and accuracy is mathruler's `grade_answer` of the last \boxed{} content (or of the
# whole response with use_boxed=False) against the ground truth.
# Needs the PyPI package mathruler (with pylatexenc and tqdm) in the interpreter of `reward.python`.
import re

from mathruler.grader import extract_boxed_content, grade_answer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, use_boxed=True, format_score=0.1):
    formatted = 1.0 if _FORMAT.fullmatch(solution_str) else 0.0
    answer = extract_boxed_content(solution_str) if use_boxed else solution_str
    accurate = 1.0 if grade_answer(answer, ground_truth) else 0.0
    return (1.0 - format_score) * accurate + format_score * formatted
