"""The comparison's pipeline section: a pipelined run's bubble (measured and replayed) and
what each stage holds, from its own records and header."""

from dtlab.lab.compare import analysis, report
from dtlab.lab.compare.registry import parse
from dtlab.lab.compare.runner import Outcome


def test_bubbles_and_the_kept_weight_version_reach_the_report():
    header = {"config": {"run": {}}, "param_bytes": 400, "grad_bytes": 400,
              "optimizer_bytes": 800, "weight_version_bytes": 400,
              "stage_weight_version_bytes": [400, 384]}
    records = [{"bubble": 0.2, "bubble_replay": 0.1}, {"bubble": 0.4, "bubble_replay": 0.1}]
    assert analysis.pipeline(records) == {"bubble": 0.30000000000000004,
                                          "bubble_replay": 0.1}
    assert analysis.pipeline([{"loss": 1.0}]) is None  # no pipeline, no section
    ran = analysis.what_ran("sync", [header], [records])
    assert ran["stage_weight_version_bytes"] == [400, 384]
    assert ran["memory"]["per_rank_bytes"] == 2000
    spec = parse("sync-pipedream-2bw")
    piped = report.Result(Outcome(spec, []), None, {"pipeline": analysis.pipeline(records)}, ran)
    plain = report.Result(Outcome(parse("sync-ring"), []), None, {"pipeline": None}, {})
    lines = report.pipeline_lines([plain, piped])
    assert lines[0] == "## Pipelines"
    assert "| sync-pipedream-2bw | 0.300 | 0.100 | 0.4, 0.4 | 2.0 |" in lines
    assert not any("sync-ring" in line for line in lines)
    assert report.pipeline_lines([plain]) == []
