"""The ServerApp: shuffledp's strategy with the app's own model and central evaluation."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from cnn_app.task import evaluate, load_images, new_model, split
from shuffledp.server.strategy import ShuffleStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the shuffled rounds on the app's CNN; evaluate each round on the server's test split."""
    rc = context.run_config
    size, seed = int(rc["image-size"]), int(rc["seed"])
    images = load_images(str(rc["data-dir"]), size, int(rc["generated-per-class"]), seed)
    _, test = split(images, seed)
    model = new_model(size, len(images.classes), seed)

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, images.x[test], images.y[test])
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    strategy = ShuffleStrategy.from_context(context)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), evaluate_fn=central)
    print(f"[cnn_app] final server metrics: {result.evaluate_metrics_serverapp}", flush=True)
