"""`GET /trikv/stats` on `trikv serve`: the compaction counters of every worker, for monitoring and soak tests.

A vLLM endpoint plugin (entry point `vllm.endpoint_plugins`, name `trikv_stats`). vLLM loads endpoint plugins only
when they are named in `VLLM_PLUGINS`; `trikv serve` names it (with the general plugins it finds) unless
`VLLM_PLUGINS` is already set. The route calls the workers' `trikv_stats` (see `worker.py`) and returns one dict
per tensor-parallel rank: rounds, seconds spent compacting, the most requests running at once, preemptions,
requests compacted so far, the ids of running requests that hold a compacted cache and the kept states the rank
holds positions for; each rank's dict also carries the engine's session reuse figures under "sessions" (states
kept now and their blocks, hits, partial hits with the tokens reused, misses, drops: the scheduler's
`trikv_session_stats`, read through vLLM's engine-core utility call).
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
            from .session_reuse import ENGINE_UTILITY

            engine = request.app.state.trikv_engine
            ranks = await engine.collective_rpc("trikv_stats")
            sessions = await engine.engine_core.call_utility_async(ENGINE_UTILITY)
            return [{**rank, "sessions": sessions} for rank in ranks]

    async def init_state(self, engine_client, state, args):
        state.trikv_engine = engine_client


def plugin() -> StatsEndpoint:
    return StatsEndpoint()


def plugins_setting() -> str:
    """The `VLLM_PLUGINS` value that loads every installed general plugin and this endpoint."""
    from importlib.metadata import entry_points

    names = [entry.name for entry in entry_points(group="vllm.general_plugins")]
    return ",".join(dict.fromkeys([*names, NAME]))
