"""One vLLM engine's greedy completions and samples at temperature 1, in its own process (vLLM 0.31 cannot start a second
engine in a process after closing one): ``python -m tests.trl_vllm.sample_run plain|spec OUT.json``.

The engine and samples are :mod:`tests.openrlhf.vllm_cpu_engine`'s (a tiny Llama with a peaked
head at W0; ``spec``: forkrl's int4 drafter, 4 tokens); writes the greedy completions (prompts of
different lengths, stop tokens), the samples and vLLM's speculative counters over the samples.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from forkrl.plugins.vllm.speculative import spec_counters
    from tests.openrlhf import vllm_cpu_engine as run

    mode, out = sys.argv[1], Path(sys.argv[2])
    (w0, _, _), _ = run.save_policies(out.parent)
    llm = run.engine(w0, speculative=mode == "spec")
    greedy, _ = run.generate(llm)
    before = spec_counters(llm.get_metrics())
    samples = run.sample(llm)
    after = spec_counters(llm.get_metrics())
    counts = {k: after[k] - before[k] for k in after}
    out.write_text(json.dumps({"greedy": greedy, "samples": samples, "counts": counts}))


if __name__ == "__main__":
    main()
