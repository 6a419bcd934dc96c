"""Stand-in for vllm.logger (vLLM's logging setup): init_logger is logging.getLogger."""
import logging


def init_logger(name):
    return logging.getLogger(name)
