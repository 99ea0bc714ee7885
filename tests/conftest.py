"""Settings for every test process (and the subprocesses they start, through the environment)."""

import os
import tempfile

# MindFormers writes ./output/log when imported unless told where: keep it out of the work tree.
os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "xf-align-mf-output"))

# `make test` runs `pytest -n 2 --dist loadfile`: whole files go to the two workers. pytest-xdist hands them out
# in order of test count by default, so the few-test, long files (a paired demo, an msrun launch) went last and
# one worker ran them alone at the end. Longest first instead (files not listed keep their order, after these):
# seconds per file summed from `--durations=0` on 2 cores, load 7-28, 2026-11-29 (only the order matters); the four
# demo files scaled by what sharing framework processes (demo.fault_batch) saved them alone at load 5-12.
LONG_FILES = {
    "test_demo.py": 473, "test_demo_moe.py": 274, "test_mindformers_launch.py": 274,
    "test_replay_layout_msrun.py": 201, "test_demo_baseline_faults.py": 188,
    "test_interrupt.py": 162, "test_megatron_layouts.py": 151, "test_mindformers_yaml.py": 146,
    "test_mindspore_graph_capture.py": 134, "test_readme.py": 131, "test_core_install.py": 117,
    "test_compare_weights.py": 113, "test_demo_legacy.py": 112, "test_graph_full_tensors.py": 90,
    "test_report_cli.py": 82, "test_self_check.py": 80, "test_fuzz.py": 80, "test_mindformers_moe.py": 79,
    "test_mcore_presets.py": 71, "test_local_norm_compare.py": 67,
    "test_stages.py": 60, "test_megatron_dumper.py": 55, "test_mindformers_mcore.py": 49, "test_extending.py": 46,
    "test_mindformers_mtp.py": 32, "test_mindspore_graph_mode.py": 31, "test_repro.py": 29,
    "test_mindformers_replay.py": 28, "test_trajectories.py": 26, "test_torch_dumper.py": 26,
    # added in session 14, alone at load 5-9: drill 100-150 s, sample hashes 72, layer gather 56, drill MoE 54,
    # isolation faults 45
    "test_drill.py": 120, "test_sample_hashes.py": 72, "test_layer_gather_mindformers.py": 56,
    "test_drill_moe.py": 54, "test_isolation_faults.py": 45,
}


def pytest_configure(config) -> None:  # noqa: ANN001
    if hasattr(config.option, "loadscopereorder"):     # pytest-xdist: schedule files in collection order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    """Longest files first (a stable sort: a file's tests keep their order, the other files theirs)."""
    items.sort(key=lambda item: -LONG_FILES.get(item.path.name, 0) if item.path.parent.name == "tests" else 0)
