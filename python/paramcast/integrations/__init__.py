"""Adapters that plug ParamCast into the engines and trainers users already run (``paramcast.integrations.vllm``)."""
