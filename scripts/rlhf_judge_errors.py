"""What a trained preference model gets wrong: every held-out comparison judged, the misjudged ones printed.

    POSTTRAIN_STATE_DIR=/tmp/rlhf-tuning .venv/bin/python scripts/rlhf_judge_errors.py [partition] [--show 20]

Judges the held-out rows of the comparisons table the preference model (default: the newest) was trained on,
in both orders, and prints the comparison accuracy ± s.e. (n), the accuracy with the chosen first / second,
the position bias, the share of comparisons whose rejected side is malformed (no ``\\boxed`` answer) or empty,
accuracy on the well-formed ones, and the misjudged comparisons (prompt, chosen, rejected, P(chosen)). A judge
trained with reference answers writes its own first (as in RLHF); the script then also prints how often its
answer is the chosen text, and its answer beside each misjudged comparison. ``--reference-from PARTITION`` has
that checkpoint write the reference answers instead, as RLHF's ``judge_reference_from`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("partition", nargs="?", default="", help="preference-model checkpoint partition (default: the newest)")
    parser.add_argument("--show", type=int, default=15, help="misjudged comparisons to print")
    parser.add_argument("--reference-from", default="", help="checkpoint partition whose greedy answers are the references")
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from assets.checkpoint_manifest import all_manifests, manifest_path, read_manifest
    from assets.preference_model import heldout_comparisons, judge_answers_first
    from posttrain.eval.answers import extract_answer
    from posttrain.eval.stats import mean_estimate
    from posttrain.preference.comparison_eval import own_answer_is_chosen
    from posttrain.preference.preference_model import verdict_correct
    from posttrain.preference.comparison_format import ComparisonRenderer
    from posttrain.preference.preference_model import PreferenceModel
    from posttrain.renderers import get_renderer
    from resources.models import load_tokenizer
    from resources.state import state_subdir
    from resources.tinker import TinkerResource

    manifest = read_manifest(args.partition) if args.partition else max(
        (m for m in all_manifests() if m.recipe == "preference_model"), key=lambda m: manifest_path(m.partition).stat().st_mtime)
    asset = manifest.related["comparisons"]["asset"]
    table = pq.read_table(state_subdir("parquet") / f"{asset}.parquet")
    comparisons = heldout_comparisons(table)
    renderer = ComparisonRenderer(get_renderer(manifest.renderer or "chatml", load_tokenizer(manifest.base_model)))
    client = TinkerResource().get_client()
    answers_first = judge_answers_first(manifest.related["comparisons"])
    answerer = None
    if args.reference_from:
        if not answers_first:
            parser.error(f"--reference-from: {manifest.partition} was trained without reference answers; it reads none")
        answerer = client.create_sampling_client(model_path=read_manifest(args.reference_from).sampler_path).result()
    judge = PreferenceModel(client.create_sampling_client(model_path=manifest.sampler_path).result(), renderer,
                            answers_first=answers_first, answerer=answerer)
    verdicts = judge.judge(comparisons)
    own = [judge.own_answer(c.prompt) for c in comparisons]
    correct = [verdict_correct(v.first_wins) for v in verdicts]
    chosen_first = [verdict_correct((1.0 - v.forward.score) / 2) for v in verdicts]
    chosen_second = [verdict_correct((1.0 + v.swapped.score) / 2) for v in verdicts if v.swapped]
    formed = [extract_answer(c.completion_b[0]["content"]) is not None for c in comparisons]
    references = f", references by {args.reference_from}" if args.reference_from else ""
    print(f"{manifest.partition} on {len(comparisons)} held-out {asset} comparisons{references}")
    for name, values in (("comparison_accuracy", correct), ("accuracy_chosen_first", chosen_first),
                         ("accuracy_chosen_second", chosen_second), ("position_bias", [v.position_bias for v in verdicts]),
                         ("rejected_has_answer", [float(f) for f in formed]),
                         ("accuracy | rejected has answer", [c for c, f in zip(correct, formed) if f]),
                         ("accuracy | rejected has none", [c for c, f in zip(correct, formed) if not f]),
                         ("own_answer_is_chosen", [m for c in comparisons if (m := own_answer_is_chosen(judge, c)) is not None])):
        if values:
            estimate = mean_estimate(values)
            print(f"  {name:<32} {estimate.value:.3f} ± {estimate.stderr:.3f} (n = {estimate.n})")
    wrong = [(c, v, o) for c, v, o, ok in zip(comparisons, verdicts, own, correct) if ok < 1.0]
    for comparison, verdict, answer in wrong[: args.show]:
        print(f"- {comparison.prompt[-1]['content'][:60]!r}: chosen {comparison.completion_a[0]['content']!r} "
              f"rejected {comparison.completion_b[0]['content']!r} P(chosen) {verdict.first_wins:.2f} bias {verdict.position_bias:+.2f}"
              + (f" own answer {answer!r}" if answer is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
