"""The end-to-end runs' reward (veRL's ``reward.custom_reward_function``): the fraction of digits in the
response, dense enough that a tiny random model's GRPO groups are not all ties."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
