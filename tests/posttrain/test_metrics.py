import io

from posttrain.metrics import ConsoleMetricsLogger, JsonlMetricsLogger, MetricsLogger, MultiLogger, read_metrics


def test_jsonl_logger_appends_rows_and_truncates_from_a_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    jsonl = JsonlMetricsLogger(path)
    for step in range(5):
        jsonl.log_metrics({"loss": 1.0 / (step + 1)}, step)
    jsonl.truncate_from(3)
    jsonl.log_metrics({"loss": 0.2}, 3)
    rows = read_metrics(path)
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert rows[3]["loss"] == 0.2


def test_multilogger_fans_out_and_loggers_satisfy_the_protocol(tmp_path):
    stream = io.StringIO()
    jsonl = JsonlMetricsLogger(tmp_path / "m.jsonl")
    console = ConsoleMetricsLogger(stream=stream, keys=("loss",))
    multi = MultiLogger([jsonl, console])
    assert all(isinstance(x, MetricsLogger) for x in (jsonl, console, multi))
    multi.log_params({"lr": 1e-4})
    multi.log_metrics({"loss": 0.5, "other": 2.0}, 7)
    multi.close()
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 7, "loss": 0.5, "other": 2.0}]
    assert "step 7: loss=0.5" in stream.getvalue() and "other" not in stream.getvalue().split("\n")[1]
