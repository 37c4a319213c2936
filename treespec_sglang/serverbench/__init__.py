"""The server benchmark: a matrix of server settings x policies x budgets x concurrency x temperature run
against real ``sglang.launch_server`` processes (or one running server) over HTTP; JSONL, table, plots.

Nothing here imports sglang: servers are child processes, requests are streamed ``/generate`` calls.
"""

from .matrix import Cell, ServerSetting, build_matrix, parse_servers, policy_spec
from .run import encode_prompts, load_prompts, run_matrix

__all__ = ["Cell", "ServerSetting", "build_matrix", "parse_servers", "policy_spec", "load_prompts",
           "encode_prompts", "run_matrix"]
