"""What exactness tests, benchmarks and examples share.

- :mod:`.precision`: :class:`Float64Mode` (true float64 despite transformers' float32 casts),
  :class:`Bf16Rounding` (the bf16 criterion of the precision tests).
- :class:`SavedBytes` (autograd's saved-tensor peak), :func:`peak_rss_bytes`: re-exported from the
  product module :mod:`forkrl.core.memory` (the estimator measures with them).
- :mod:`.models`: tiny model and tokenizer builders, and the plain computation to compare with.
- :mod:`.forests`: batches of token sequences with the sharing patterns forkrl must handle (GRPO
  groups, deep trees), for tests, benchmarks and the GPU checks.
- :mod:`.ranks`: multi-process runs (:func:`~.ranks.run_on_ranks`: a function on N gloo ranks,
  results as data; :func:`~.ranks.torchrun` for a host launcher's script, :func:`~.ranks.finish`).
- :mod:`.stock`: the one "equals stock" comparison every host's tests use (:func:`~.stock.relative_difference`,
  :func:`~.stock.assert_equals_stock`); :mod:`.group`: a one-rank gloo group for in-process host runs;
  :mod:`.launcher`: a host launcher run as a user runs it, and the rollout log; :mod:`.rewards`: the
  end-to-end runs' reward in each host's form.
"""

from ..memory import SavedBytes, peak_rss_bytes
from .precision import Bf16Rounding, Float64Mode

__all__ = ["Bf16Rounding", "Float64Mode", "SavedBytes", "peak_rss_bytes"]
