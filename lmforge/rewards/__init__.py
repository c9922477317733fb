"""Rewards of reinforcement learning (task_type rl): rules that score a completion, without torch.

- `answers`: the final answer of a text (``\\boxed{}``, ``#### n``, the last number) and whether
  two answers are equal (as numbers where both are);
- `functions`: the built-in rewards (``exact_match``, ``math``, ``format``), a user's own
  ``path/to/file.py:function`` with TRL's signature, and scoring a batch of completions with them —
  a reward that raises, returns the wrong number of values or NaN, or needs a column a row lacks
  is one line naming the function and the row.

The trainer (`train.rl`) samples the completions and turns the scores into advantages.
"""
