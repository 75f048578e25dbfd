"""The ClientApp: the app's own training, with shuffledp's client mod around it.

The mod checks the request against the node's pinned privacy settings before this code runs, and turns the model
this handler returns into one sealed eps0-LDP report: nothing else leaves the client.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from cnn_app.task import load_images, new_model, partition, split, train_local
from shuffledp.clients.mod import shuffle_mod

app = ClientApp(mods=[shuffle_mod])


@app.train("shuffled")  # shuffledp's strategy sends "train.shuffled"
def train(msg: Message, context: Context) -> Message:
    """Load the received model, train it on this node's images, reply with the updated model."""
    rc, nc = context.run_config, context.node_config
    size, seed = int(rc["image-size"]), int(rc["seed"])
    images = load_images(str(rc["data-dir"]), size, int(rc["generated-per-class"]), seed)
    train_idx, _ = split(images, seed)
    mine = partition(train_idx, int(nc["partition-id"]), int(nc["num-partitions"]), seed)
    model = new_model(size, len(images.classes), seed)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    train_local(model, images.x[mine], images.y[mine], epochs=int(config["local-epochs"]),
                lr=float(config["local-lr"]), batch_size=int(config["batch-size"]))
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)
