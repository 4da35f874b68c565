"""benchmarks/kernel/persistent_l2.py: reading Nsight Compute's CSV and metric listing, and the sweep's variants."""

import pytest

from benchmarks.kernel import persistent_l2
from benchmarks.kernel.persistent_l2 import METRICS, available, parse_metrics, variants

# the shape of ``ncu --csv --print-units base`` (a launch line before the table, thousands separators)
NCU_CSV = """==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","gpu","_persistent_decode_kernel","1","7","Command line profiler metrics","dram__bytes_read.sum","byte","1,987,654,321"
"0","4242","python3","gpu","_persistent_decode_kernel","1","7","Command line profiler metrics","lts__t_sectors_op_read.sum","sector","70,000,123"
"0","4242","python3","gpu","_persistent_decode_kernel","1","7","Command line profiler metrics","gpu__time_duration.sum","nsecond","912345"
"0","4242","python3","gpu","_persistent_decode_kernel","1","7","Command line profiler metrics","lts__t_sectors_op_read_lookup_hit.sum","sector","n/a"
"""


def test_the_metrics_are_read_with_their_thousands_separators() -> None:
    values = parse_metrics(NCU_CSV)
    assert values == {
        "dram__bytes_read.sum": 1_987_654_321.0,
        "lts__t_sectors_op_read.sum": 70_000_123.0,
        "gpu__time_duration.sum": 912_345.0,
    }  # the uncollected metric is left out, not read as zero


def test_output_without_a_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no CSV table"):
        parse_metrics("==ERROR== The application returned an error code (1).\n")


def test_only_the_metrics_the_listing_knows_are_asked_for() -> None:
    listing = """Device NVIDIA H100 80GB HBM3 (GH100)
dram__bytes_read                    # of bytes read from DRAM
gpu__time_duration                  total duration in nanoseconds
lts__t_sectors_op_read              # of LTS sectors for reads
"""
    kept = [metric for metric, _ in available(METRICS, listing)]
    assert kept == ["gpu__time_duration.sum", "dram__bytes_read.sum", "lts__t_sectors_op_read.sum"]


def test_the_sweep_is_the_product_of_its_fields() -> None:
    assert variants(["bubble_gate_up_k=0,1024", "kv_prefetch=0,64"]) == [
        {"bubble_gate_up_k": 0, "kv_prefetch": 0},
        {"bubble_gate_up_k": 0, "kv_prefetch": 64},
        {"bubble_gate_up_k": 1024, "kv_prefetch": 0},
        {"bubble_gate_up_k": 1024, "kv_prefetch": 64},
    ]
    assert variants(["prefetch_k=0,256"]) == [{"prefetch_k": 0}, {"prefetch_k": 256}]
    assert variants([]) == [{}]
    with pytest.raises(SystemExit, match="not FIELD"):
        variants(["no_such_field=1"])
    with pytest.raises(SystemExit, match="integers"):
        variants(["kv_prefetch=a"])


def test_without_a_gpu_or_ncu_it_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(persistent_l2.torch.cuda, "is_available", lambda: False)
    assert persistent_l2.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
