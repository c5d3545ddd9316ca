"""Draw the code location's asset graph (docs/asset_graph.png) from the real Definitions.

The README shows this picture; regenerate it after changing the graph:
`PYTHONPATH=$PWD .venv/bin/python scripts/draw_asset_graph.py`. Nodes are placed in columns by their
depth in the graph and coloured by their Dagster group; partitioned assets are drawn with a double border.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

GROUP_COLOURS = {"data": "#dbeafe", "training": "#fde68a", "eval": "#bbf7d0"}
OTHER_COLOURS = ("#fbcfe8", "#ddd6fe", "#fed7aa", "#e5e7eb")  # groups added later, in order of appearance
COLUMN_WIDTH = 3.3  # data units between columns
CHAR_WIDTH = 0.0715  # data units per monospace character at this figure size
OUTPUT = Path(__file__).resolve().parents[1] / "docs" / "asset_graph.png"


def asset_graph() -> tuple[nx.DiGraph, dict[str, str], set[str]]:
    """The asset dependency graph, each asset's group, and the partitioned assets."""
    from pipelines.definitions import defs

    resolved = defs.resolve_asset_graph()
    graph, groups, partitioned = nx.DiGraph(), {}, set()
    for key in resolved.get_all_asset_keys():
        node = resolved.get(key)
        name = key.to_user_string()
        graph.add_node(name)
        groups[name] = node.group_name
        if node.partitions_def is not None:
            partitioned.add(name)
        for parent in node.parent_keys:
            graph.add_edge(parent.to_user_string(), name)
    return graph, groups, partitioned


def layered_positions(graph: nx.DiGraph) -> dict[str, tuple[float, float]]:
    """Columns by depth; within a column, nodes ordered by their parents' mean row (fewer crossings)."""
    layers = [sorted(layer) for layer in nx.topological_generations(graph)]
    rows: dict[str, float] = {}
    for layer in layers:
        def parents_row(name: str) -> float:
            parents = [rows[parent] for parent in graph.predecessors(name) if parent in rows and parent != "base_model"]
            return sum(parents) / len(parents) if parents else -1.0
        for row, name in enumerate(sorted(layer, key=parents_row)):
            rows[name] = float(row) - (len(layer) - 1) / 2
    return {name: (COLUMN_WIDTH * depth, -rows[name]) for depth, layer in enumerate(layers) for name in layer}


def half_width(name: str) -> float:
    return CHAR_WIDTH * (len(name) + 3) / 2


def draw(output: Path = OUTPUT) -> Path:
    graph, groups, partitioned = asset_graph()
    positions = layered_positions(graph)
    figure, axes = plt.subplots(figsize=(26, 9), dpi=110)
    for source, target in graph.edges:
        (x0, y0), (x1, y1) = positions[source], positions[target]
        faint = source == "base_model"
        axes.add_patch(FancyArrowPatch(
            (x0 + half_width(source), y0), (x1 - half_width(target), y1), arrowstyle="-|>", mutation_scale=14,
            color="#cbd5e1" if faint else "#64748b", linewidth=0.7 if faint else 1.1, connectionstyle="arc3,rad=0.0",
            zorder=1,
        ))
    colours = dict(GROUP_COLOURS)
    for group in sorted(set(groups.values()) - set(colours)):
        colours[group] = OTHER_COLOURS[min(len(colours) - len(GROUP_COLOURS), len(OTHER_COLOURS) - 1)]
    for name, (x, y) in positions.items():
        box = dict(boxstyle="round,pad=0.35", facecolor=colours[groups[name]],
                   edgecolor="#334155", linewidth=2.0 if name in partitioned else 0.8,
                   linestyle="--" if name in partitioned else "-")
        axes.text(x, y, name, ha="center", va="center", fontsize=9, family="monospace", bbox=box, zorder=2)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colour, edgecolor="#334155") for colour in colours.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#334155", linewidth=2.0, linestyle="--"))
    axes.legend(handles, [f"group {group}" for group in colours] + ["partitioned (by checkpoint, or by model × benchmark)"],
                loc="lower right", fontsize=9, frameon=False)
    axes.set_title("Asset graph of pipelines.definitions (arrows point downstream; base_model's edges are pale)", fontsize=12)
    xs = [x for x, _ in positions.values()]
    ys = [y for _, y in positions.values()]
    axes.set_xlim(min(xs) - 1.3, max(xs) + 1.3)
    axes.set_ylim(min(ys) - 0.8, max(ys) + 0.8)
    axes.axis("off")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    return output


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT))
