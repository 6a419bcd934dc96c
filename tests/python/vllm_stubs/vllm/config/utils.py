"""Stand-in for vllm.config.utils: ``config`` makes a dataclass (vLLM's makes a pydantic dataclass that
forbids unknown fields; a stand-in that does the same, without pydantic)."""
import dataclasses


def config(cls=None, **_):
    def decorator(c):
        return dataclasses.dataclass(c)
    return decorator if cls is None else decorator(cls)
