"""What the runner's persistent buffers hold at a step with compaction rounds (installed by `vllm_scenario.py` on an
in-process engine through `LLM.collective_rpc`).

On CUDA, graphs captured by vLLM read the runner's persistent buffers, and only those: the block table, the slot
mapping, the positions. The probe checks, at every step that ran rounds, after the inputs are prepared, that for
each compacted request in the batch (full-attention KV cache group): its block-table row lists exactly its blocks
and is zero where the blocks it gave back were (no stale id), on the host and in the committed device copy; the
slot of each of its new tokens, in the persistent slot-mapping buffer, is the physical slot of its position less the
request's offset; and the metadata handed to attention points at those very buffers (same storage).

vLLM's CPU runner makes every "device" buffer the host tensor itself (`CPUModelRunner._postprocess_tensors`), so a
device copy would always equal the host rows. The probe gives the group's block table a device copy of its own
storage, as CUDA has: vLLM's commit (`commit_block_table`, in `_prepare_inputs`) must copy the host rows into it,
the slot mapping and attention read it, and a row rewritten after the commit would show there as stale.
"""

from __future__ import annotations


def install(worker) -> None:
    runner = worker.model_runner
    runner._trikv_probe = []
    group = runner._trikv_group
    table = runner.input_batch.block_table[group].block_table
    table.gpu = table.cpu.clone()  # a device copy with its own storage: commits now copy
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
            "device_copy_committed": (device_row[: max(held, len(ids))] == host_row[: max(held, len(ids))]
                                      and table.block_table.gpu.data_ptr() != table.block_table.cpu.data_ptr()),
            "slots_physical": [s for s, r in zip(slots, rows_of_tokens) if r == row] == expected and bool(expected),
        })
    return {"requests": requests}


def findings(worker) -> list[dict]:
    return worker.model_runner._trikv_probe


def set_kv_scales(worker, k_scale: float, v_scale: float) -> None:
    """Give every attention layer these fp8 KV scales, as a quantised checkpoint would (vLLM keeps each layer's
    device tensor and its host float equal: the CPU kernels read the float, CUDA's and trikv's rounds the tensor)."""
    from vllm.model_executor.layers.attention.attention import Attention

    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        if isinstance(layer, Attention):
            layer._k_scale.fill_(k_scale)
            layer._v_scale.fill_(v_scale)
            layer._k_scale_float, layer._v_scale_float = k_scale, v_scale


def record_keys(worker) -> None:
    """Record the keys every layer of the full-attention group hands vLLM's KV write (post-RoPE, before any
    quantisation), with each token's request and position: what the cache then holds is that write's doing, which a
    test can model on its own (`keys_written` returns them)."""
    from vllm.model_executor.models.utils import extract_layer_index

    runner = worker.model_runner
    group = runner.kv_cache_config.kv_cache_groups[runner._trikv_group]
    runner._trikv_written = {}  # request id -> layer -> [(positions [n], keys [n, Hkv, D])]
    context = runner.compilation_config.static_forward_context
    for name in group.layer_names:
        impl, index = context[name].impl, extract_layer_index(name)
        write = impl.do_kv_cache_update

        def recorded(layer, key, value, kv_cache, slot_mapping, _write=write, _index=index):
            tokens = key.shape[0]
            rows = runner.req_indices.gpu[:tokens]
            positions = runner.positions[:tokens]
            for row in rows.unique().tolist():
                mine = rows == row
                per_layer = runner._trikv_written.setdefault(runner.input_batch.req_ids[row], {}).setdefault(_index, [])
                per_layer.append((positions[mine].clone(), key[mine].clone()))
            return _write(layer, key, value, kv_cache, slot_mapping)

        impl.do_kv_cache_update = recorded


def keys_written(worker, path: str) -> str:
    """Save the recorded keys to `path` ({request id: {layer: (positions [T], keys [T, Hkv, D])}}, in position order)."""
    import torch

    saved = {}
    for request_id, layers in worker.model_runner._trikv_written.items():
        saved[request_id] = {}
        for index, parts in layers.items():
            positions = torch.cat([p for p, _ in parts])
            keys = torch.cat([k for _, k in parts])
            order = positions.argsort()
            saved[request_id][index] = (positions[order], keys[order])
    torch.save(saved, path)
    return path
