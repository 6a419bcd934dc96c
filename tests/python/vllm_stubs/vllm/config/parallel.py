"""Stand-in for vllm.config.parallel: base.py uses ParallelConfig as an annotation only."""


class ParallelConfig:
    pass
