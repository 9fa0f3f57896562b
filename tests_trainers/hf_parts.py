"""What the HF Trainer tests train (one process and two): a synthetic token data set, a callback that keeps the
logged losses, and a tiny BERT classifier built from a config (random init, no download)."""
import torch
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback


class Data(torch.utils.data.Dataset):
    """Token sequences labelled by whether token 7 occurs (synthetic, made here)."""

    def __init__(self, n=96, length=12):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (n, length), generator=g)
        self.labels = (self.ids == 7).any(1).long() | (self.ids[:, 0] > 40).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Losses(TrainerCallback):
    """The training losses the Trainer logs, in order."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32, num_labels=2))
