"""What the runner's persistent buffers hold at a step with compaction rounds (installed by `vllm_scenario.py` on an
in-process engine through `LLM.collective_rpc`).

On CUDA, graphs captured by vLLM read the runner's persistent buffers, and only those: the block table, the slot
mapping, the positions. The probe checks, at every step that ran rounds, after the inputs are prepared, that for
each compacted request in the batch (full-attention KV cache group): its block-table row lists exactly its blocks
and is zero where the blocks it gave back were (no stale id), on the host and in the committed device copy; the
slot of each of its new tokens, in the persistent slot-mapping buffer, is the physical slot of its position less the
request's offset; and the metadata handed to attention points at those very buffers (same storage).
"""

from __future__ import annotations


def install(worker) -> None:
    runner = worker.model_runner
    runner._trikv_probe = []
    group = runner._trikv_group
    prepare = runner._prepare_inputs

    def probed_prepare(scheduler_output, num_scheduled_tokens):
        result = prepare(scheduler_output, num_scheduled_tokens)
        plan = getattr(scheduler_output, "trikv", None)
        runner._trikv_probe_step = None
        if plan is not None and plan.rounds:
            runner._trikv_probe_step = _step_findings(runner, group, plan, scheduler_output.total_num_scheduled_tokens)
            runner._trikv_probe.append(runner._trikv_probe_step)
        return result

    runner._prepare_inputs = probed_prepare
    for attn_group in runner.attn_groups[group]:
        build = attn_group.build_metadata

        def probed_build(common, *args, _build=build, **kwargs):
            step = getattr(runner, "_trikv_probe_step", None)
            if step is not None:
                table = runner.input_batch.block_table[group]
                step["metadata"] = {
                    "slot_mapping_is_buffer": common.slot_mapping.data_ptr() == table.slot_mapping.gpu.data_ptr(),
                    "block_table_is_buffer": common.block_table_tensor.data_ptr() == table.block_table.gpu.data_ptr(),
                }
            return _build(common, *args, **kwargs)

        attn_group.build_metadata = probed_build


def _step_findings(runner, group: int, plan, total_tokens: int) -> dict:
    table = runner.input_batch.block_table[group]
    block_size = table.block_size
    slots = table.slot_mapping.gpu[:total_tokens].tolist()
    positions = runner.positions[:total_tokens].tolist()
    rows_of_tokens = runner.req_indices.np[:total_tokens].tolist()
    requests = []
    for op in plan.rounds:
        row = runner.input_batch.req_id_to_index.get(op.request_id)
        if row is None:
            continue
        ids = list(runner.requests[op.request_id].block_ids[group])
        held = op.kept_blocks + op.freed_blocks  # the blocks the request held before the round
        host_row = table.block_table.np[row].tolist()
        device_row = table.block_table.gpu[row].tolist()
        offset = plan.offsets[op.request_id]
        expected = [ids[(p - offset) // block_size] * block_size + (p - offset) % block_size
                    for p, r in zip(positions, rows_of_tokens) if r == row]
        requests.append({
            "request_id": op.request_id, "offset": offset,
            "lists_its_blocks": host_row[: len(ids)] == ids,
            "stale_ids_cleared": all(block == 0 for block in host_row[len(ids) : max(held, len(ids))]),
            "device_copy_committed": device_row[: max(held, len(ids))] == host_row[: max(held, len(ids))],
            "slots_physical": [s for s, r in zip(slots, rows_of_tokens) if r == row] == expected and bool(expected),
        })
    return {"requests": requests}


def findings(worker) -> list[dict]:
    return worker.model_runner._trikv_probe
