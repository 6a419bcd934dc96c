"""Stand-in for vLLM's layerwise reload (vllm.model_executor.model_loader.reload), which needs vLLM's
model layers and kernels. It keeps vLLM's rule: a reload initialized by start_weight_update stays open
until finalize_layerwise_reload; an engine that never finalizes leaves it open (vLLM then skips
re-initializing the open layers: the next round loads into a half-set-up reload)."""

STATE = {"open": False, "initialized": 0, "finalized": 0, "initialized_while_open": 0}


def initialize_layerwise_reload(model):
    if STATE["open"]:
        STATE["initialized_while_open"] += 1
    STATE["open"] = True
    STATE["initialized"] += 1


def finalize_layerwise_reload(model, model_config):
    STATE["open"] = False
    STATE["finalized"] += 1
