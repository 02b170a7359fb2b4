"""`GET /trikv/stats` on `trikv serve`: the compaction counters of every worker, for monitoring and soak tests.

A vLLM endpoint plugin (entry point `vllm.endpoint_plugins`, name `trikv_stats`). vLLM loads endpoint plugins only
when they are named in `VLLM_PLUGINS`; `trikv serve` names it (with the general plugins it finds) unless
`VLLM_PLUGINS` is already set. The route calls the workers' `trikv_stats` (see `worker.py`) and returns one dict
per tensor-parallel rank: rounds, seconds spent compacting, the most requests running at once, preemptions,
requests compacted so far and the ids of running requests that hold a compacted cache.
"""

# no `from __future__ import annotations`: FastAPI reads the route's parameter types at definition time
NAME = "trikv_stats"


class StatsEndpoint:
    name = NAME
    required_tasks = ("generate",)

    def attach_router(self, app):
        from fastapi import Request

        @app.get("/trikv/stats")
        async def trikv_stats(request: Request):
            return await request.app.state.trikv_engine.collective_rpc("trikv_stats")

    async def init_state(self, engine_client, state, args):
        state.trikv_engine = engine_client


def plugin() -> StatsEndpoint:
    return StatsEndpoint()


def plugins_setting() -> str:
    """The `VLLM_PLUGINS` value that loads every installed general plugin and this endpoint."""
    from importlib.metadata import entry_points

    names = [entry.name for entry in entry_points(group="vllm.general_plugins")]
    return ",".join(dict.fromkeys([*names, NAME]))
