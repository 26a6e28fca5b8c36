"""bolts' ``CIFAR10DataModule`` reading an ImageFolder tree instead of the CIFAR-10 archive.

lightning-bolts' ``CIFAR10DataModule`` builds its datasets with
``torchvision.datasets.CIFAR10(data_dir, train=..., download=True)``, which needs the
original ``cifar-10-python.tar.gz`` (downloaded on first use). Machines without that
archive have a CIFAR-10 subset as an ImageFolder tree (``<root>/train/<class>/*.jpg`` and
``<root>/test/<class>/*.jpg``, as ``.github/scripts/cifar10-subset.sh DIR`` builds from public CIFAR-10 images).

:class:`ImageFolderCIFAR10DataModule` *is* bolts' ``CIFAR10DataModule`` (subclass, runs on
Lightning 1.9) with one attribute changed: ``dataset_cls``. Every other rule stays bolts'
own code: 20% validation share (``int(0.2 * n)``) split off the training pool with
``random_split(generator=torch.Generator().manual_seed(42))``, ``ToTensor`` only
(``normalize=False``), ``shuffle=True`` for training, ``drop_last=False``,
``dims = (3, 32, 32)``, ``from_argparse_args``.

Each sample is ``(x, y)`` with ``x: (3, 32, 32) float32`` in ``[0, 1]`` and ``y`` the class
index in CIFAR-10's label order (the alphabetical folder order).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

from pl_bolts.datamodules import CIFAR10DataModule
from torchvision.datasets import ImageFolder

__all__ = ["ImageFolderCIFAR10", "ImageFolderCIFAR10DataModule", "check_image_folder", "DataDirError"]

_IMAGE_EXTS = (".jpg", ".jpeg", ".png")


class DataDirError(ValueError):
    """``data_dir`` is not an ImageFolder CIFAR-10 tree; ``str(err)`` is one line."""


def check_image_folder(data_dir: str, split: str = "train") -> str:
    """Return ``data_dir/split`` if it holds ``<class>/<image>`` files, else raise :class:`DataDirError`.

    Args:
        data_dir: the tree's root (holding ``train/`` and optionally ``test/``).
        split: ``"train"`` or ``"test"``.
    """
    root = os.path.join(os.path.expanduser(data_dir), split)
    if not os.path.isdir(root):
        raise DataDirError(f"--data_dir {data_dir!r} has no {split}/ folder: expected an ImageFolder tree "
                           f"<dir>/{split}/<class>/<image>.jpg; .github/scripts/cifar10-subset.sh DIR builds one")
    for cls in sorted(os.listdir(root)):
        d = os.path.join(root, cls)
        if os.path.isdir(d) and any(f.lower().endswith(_IMAGE_EXTS) for f in os.listdir(d)):
            return root
    raise DataDirError(f"--data_dir {data_dir!r}: {split}/ holds no <class>/<image>.jpg|.png files")


class ImageFolderCIFAR10(ImageFolder):
    """Drop-in for ``torchvision.datasets.CIFAR10`` with the signature bolts calls:
    ``(root, train=True, transform=None, download=False)``.

    Reads ``root/train`` (``train=True``) or ``root/test``; ``download`` is accepted and
    ignored (nothing is fetched). Images are decoded with PIL as RGB, as CIFAR10 does.
    """

    def __init__(self, root: str, train: bool = True, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, download: bool = False) -> None:
        super().__init__(check_image_folder(root, "train" if train else "test"), transform=transform,
                         target_transform=target_transform)
        self.train = train


class ImageFolderCIFAR10DataModule(CIFAR10DataModule):
    """bolts' ``CIFAR10DataModule`` over :class:`ImageFolderCIFAR10`; same arguments.

    ``len(dataset_train) = n - int(0.2 * n)`` and ``len(dataset_val) = int(0.2 * n)`` with
    ``n`` the number of training images (10,000 in the CIFAR-10 subset: 8,000 / 2,000).
    """

    name = "cifar10-imagefolder"
    dataset_cls = ImageFolderCIFAR10

    def __init__(self, data_dir: Optional[str] = None, val_split: Union[int, float] = 0.2, num_workers: int = 0,
                 normalize: bool = False, batch_size: int = 32, seed: int = 42, shuffle: bool = True,
                 pin_memory: bool = True, drop_last: bool = False, *args: Any, **kwargs: Any) -> None:
        # bolts' signature spelled out: Lightning's ``from_argparse_args`` passes only the arguments it sees
        # in ``__init__``'s signature (with ``*args, **kwargs`` alone, ``--batch_size`` was silently dropped)
        super().__init__(data_dir, val_split, num_workers, normalize, batch_size, seed, shuffle, pin_memory,
                         drop_last, *args, **kwargs)
        check_image_folder(self.data_dir, "train")

    @property
    def num_samples(self) -> int:
        """Training images after the validation split (bolts hard-codes 50,000 before the split)."""
        train_len, _ = self._get_splits(len_dataset=len(ImageFolderCIFAR10(self.data_dir, train=True)))
        return train_len

    def prepare_data(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to download; bolts' version would fetch the CIFAR-10 archive. Checks the tree."""
        check_image_folder(self.data_dir, "train")
