"""Small helpers for training vaswani models with transformers' `Trainer`."""

import torch


class TensorDataset(torch.utils.data.Dataset):
    """Named tensors of equal length, served as the dicts of tensors that `Trainer` feeds to the model.

    Example:
        >>> import torch
        >>> from vaswani.training import TensorDataset
        >>> dataset = TensorDataset(input_ids=torch.zeros(4, 8, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long))
        >>> len(dataset), sorted(dataset[0])
        (4, ['input_ids', 'labels'])
    """

    def __init__(self, **tensors: torch.Tensor) -> None:
        lengths = {name: len(tensor) for name, tensor in tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"TensorDataset needs tensors of one length, got {lengths}.")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}
