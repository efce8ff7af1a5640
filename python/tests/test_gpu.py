"""CUDA ranks over torch CUDA tensors: bytes, ordering on torch streams, the copy's event. Skipped
without a CUDA GPU (run on the accelerator machine)."""

import pytest

import kvtier

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kvtier.cuda_available()), reason="needs a CUDA GPU"
)

PAGES = 64


def _kv():
    # llama3-8b layout: 64 arenas [pages * 16, 8, 128] bf16 = 32,768 B per page.
    return [torch.zeros((PAGES * 16, 8, 128), dtype=torch.bfloat16, device="cuda:0") for _ in range(64)]


def test_save_restore_with_torch_streams_and_events():
    kv = _kv()
    names = [a["name"] for a in kvtier.Geometry.preset("llama3-8b", 1).arenas]
    g = kvtier.Geometry.from_tensors(kv, model="Llama-3-8B", names=names)
    assert g.namespace == kvtier.Geometry.preset("llama3-8b", PAGES).namespace
    tier = kvtier.Tier(g, 32 * g.slot_bytes)
    with tier.attach_cuda(0, kv) as rank:
        assert rank.backend == "cuda" and rank.device == 0
        stream = torch.cuda.current_stream()
        src, dst = list(range(8)), [40, 17, 33, 9, 60, 22, 50, 12]
        for i, t in enumerate(kv):
            for j, p in enumerate(src):
                t[p * 16 : (p + 1) * 16] = i + j / 8  # written by kernels on the current stream
        keys = tier.namespace.keys([f"page-{p}".encode() for p in src])
        ticket = rank.save(keys, src, after_stream=stream)  # ordered after the writes, no sync
        assert ticket.handle.cuda_event is not None
        ticket.wait()
        expect = [t[torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in src])].clone() for t in kv]
        for t in kv:
            t.fill_(float("nan"))
        with tier.query(keys) as lease:
            h = rank.restore(lease, dst, after_stream=stream)
        assert isinstance(h.cuda_event, int)
        h.stream_wait(stream)  # the compute stream waits for the restore, no host sync
        rows = torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in dst]).cuda()
        got = [t.index_select(0, rows) for t in kv]  # queued after the wait
        for e, x in zip(expect, got):
            assert torch.equal(e.view(torch.int16), x.view(torch.int16))
        h.wait()
        # The event stays valid after completion while the handle lives.
        other = torch.cuda.Stream()
        h.stream_wait(other)
        other.synchronize()
        s = tier.stats()
        assert s["restored_blocks"] == 8 and s["saved_blocks"] == 8


def test_attach_cuda_checks_the_device():
    kv = _kv()
    g = kvtier.Geometry.from_tensors(kv, model="m")
    tier = kvtier.Tier(g, 4 * g.slot_bytes)
    with pytest.raises(kvtier.DeviceMismatchError):
        tier.attach_cuda(0, [t.cpu() for t in kv])
    with pytest.raises(kvtier.DeviceMismatchError):
        tier.attach_host(kv)
    if torch.cuda.device_count() == 1:
        with pytest.raises(kvtier.DeviceMismatchError):
            tier.attach_cuda(1, kv)
