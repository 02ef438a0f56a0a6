"""forkrl's host integrations: :mod:`.trl` (TRL's GRPO/RLOO trainers), :mod:`.verl` (veRL's FSDP2
engine, override YAMLs), :mod:`.openrlhf` (OpenRLHF's launcher and Ray actors), :mod:`.vllm`
(the self-drafter in vLLM), :mod:`.deepspeed` (ZeRO-3's gather), :mod:`.fields` (batch fields by
content)."""
