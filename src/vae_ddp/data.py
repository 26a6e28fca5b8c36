"""Data as LightningDataModules: CIFAR-10 (torchvision), any ImageFolder tree, and
scikit-learn's bundled digits (the embedded default, no download).

All three follow lightning-bolts 0.7.0's ``CIFAR10DataModule`` / ``VisionDataModule``
rules: the training pool is split into train / validation with
``random_split(..., generator=torch.Generator().manual_seed(42))`` and a 20% validation
share (``int(0.2 * n)``), images are ``ToTensor`` floats in ``[0, 1]`` (normalised only
if ``normalize=True``), no augmentation, shuffling on, ``drop_last`` off.

Images are decoded once and kept in memory as ``uint8`` ``(N, 3, 32, 32)`` tensors; each
sample is returned as ``(x, y)`` with ``x: (3, 32, 32) float32`` and ``y`` the class index.

Bad input raises plain exceptions whose message names the argument (``data_dir``):
``FileNotFoundError``, ``NotADirectoryError`` or ``ValueError``. The ``vae-ddp`` command
turns them into one line with its flag (``--data_dir``) and exit code 2
([`input_error`][vae_ddp.errors.input_error]).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import torch
from pytorch_lightning import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, random_split

from vae_ddp.fixes.sampler import GlobalBatchDistributedSampler
from vae_ddp.workers import loader_kwargs

__all__ = ["ImageTensorDataset", "CIFAR10DataModule", "ImageFolderDataModule", "DigitsDataModule", "DATASETS",
           "make_datamodule", "check_data", "CIFAR10_MEAN", "CIFAR10_STD"]

#: Data names accepted by ``vae-ddp --data``.
DATASETS = ("digits", "cifar10", "imagefolder")
#: bolts' ``cifar10_normalization`` (pl_bolts.transforms.dataset_normalizations).
CIFAR10_MEAN = (125.3 / 255.0, 123.0 / 255.0, 113.9 / 255.0)
CIFAR10_STD = (63.0 / 255.0, 62.1 / 255.0, 66.7 / 255.0)
SAMPLERS = ("default", "global")
_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


class ImageTensorDataset(Dataset):
    """In-memory images: ``images: (N, 3, H, W) uint8``, ``labels: (N,) int64``.

    ``__getitem__`` returns ``(images[i] / 255, labels[i])`` as ``float32``, exactly what
    ``torchvision.transforms.ToTensor`` gives for the same pixels, then the CIFAR-10
    normalisation if ``normalize``. With ``return_index`` the second item is ``i`` (the
    index in this dataset), so that a run can record which samples each step saw.
    """

    def __init__(self, images: Tensor, labels: Tensor, normalize: bool = False, return_index: bool = False) -> None:
        self.images, self.labels, self.normalize, self.return_index = images, labels, normalize, return_index
        self._mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
        self._std = torch.tensor(CIFAR10_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].float().div(255)
        if self.normalize:
            x = (x - self._mean) / self._std
        return x, (i if self.return_index else int(self.labels[i]))


def _subset(images: Tensor, labels: Tensor, max_samples: Optional[int]) -> tuple[Tensor, Tensor]:
    """A fixed random subset of ``max_samples`` (seed 0), for quick runs; all if None."""
    if max_samples is None or max_samples >= len(labels):
        return images, labels
    idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[:max_samples].sort().values
    return images[idx], labels[idx]


class _InMemoryDataModule(LightningDataModule):
    """Shared train/val split and loaders; subclasses implement ``_load()``.

    The batch is given once, as one of: ``batch_size``, per device (Lightning's convention: each
    of N DDP ranks loads that many; default 32), or ``global_batch_size``, the samples of one
    optimizer step over all devices, which the loaders divide by the trainer's world size
    (``per_device_batch_size``); with ``sampler="global"`` the sampler gets it as it is.

    Raises:
        ValueError: both ``batch_size`` and ``global_batch_size``; an unknown ``sampler``.
    """

    def __init__(self, batch_size: Optional[int] = None, val_split: float = 0.2, seed: int = 42, num_workers: int = 0,
                 normalize: bool = False, shuffle: bool = True, drop_last: bool = False,
                 max_samples: Optional[int] = None, sampler: str = "default", sampler_seed: Optional[int] = None,
                 return_index: bool = False, global_batch_size: Optional[int] = None) -> None:
        super().__init__()
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}: use one of {', '.join(SAMPLERS)}")
        if batch_size is not None and global_batch_size is not None:
            raise ValueError(f"batch_size={batch_size} (per device) and global_batch_size={global_batch_size}: "
                             "give one")
        self.batch_size = 32 if batch_size is None and global_batch_size is None else batch_size
        self.global_batch_size, self.val_split, self.seed = global_batch_size, val_split, seed
        self.num_workers, self.normalize, self.shuffle, self.drop_last = num_workers, normalize, shuffle, drop_last
        self.max_samples, self.sampler, self.sampler_seed = max_samples, sampler, sampler_seed
        self.return_index = return_index
        self.dataset_train: Optional[Dataset] = None
        self.dataset_val: Optional[Dataset] = None

    def _load(self) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.dataset_train is not None:
            return
        images, labels = _subset(*self._load(), self.max_samples)
        full = ImageTensorDataset(images, labels, self.normalize, self.return_index)
        val_len = int(self.val_split * len(full))
        self.dataset_train, self.dataset_val = random_split(
            full, [len(full) - val_len, val_len], generator=torch.Generator().manual_seed(self.seed))

    def _world(self) -> tuple[int, int]:
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)

    @property
    def per_device_batch_size(self) -> int:
        """What each rank's loaders batch: ``batch_size``, or ``global_batch_size`` divided by the
        trainer's world size (1 without a trainer).

        Raises:
            ValueError: ``global_batch_size`` not divisible by the world size.
        """
        if self.global_batch_size is None:
            return self.batch_size
        world = self._world()[0]
        if self.global_batch_size % world:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not divisible by world size {world}")
        return self.global_batch_size // world

    def train_dataloader(self) -> DataLoader:
        """Batches of ``per_device_batch_size``. With ``sampler="global"`` the loader uses
        [`GlobalBatchDistributedSampler`][vae_ddp.fixes.sampler.GlobalBatchDistributedSampler] over the
        trainer's world size, seeded with ``sampler_seed`` or, if that is None, with ``seed_everything``'s seed
        (``PL_GLOBAL_SEED``), as Lightning's own ``DistributedSampler`` is."""
        if self.sampler == "global":
            (world, rank), b = self._world(), self.per_device_batch_size
            sampler = GlobalBatchDistributedSampler(self.dataset_train, b * world, num_replicas=world,
                                                    rank=rank, shuffle=self.shuffle, seed=self.sampler_seed)
            return DataLoader(self.dataset_train, batch_size=sampler.per_device_batch_size, sampler=sampler,
                              **loader_kwargs(self.num_workers, self.dataset_train))
        return DataLoader(self.dataset_train, batch_size=self.per_device_batch_size, shuffle=self.shuffle,
                          drop_last=self.drop_last, **loader_kwargs(self.num_workers, self.dataset_train))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset_val, batch_size=self.per_device_batch_size, shuffle=False,
                          **loader_kwargs(self.num_workers, self.dataset_val))


class DigitsDataModule(_InMemoryDataModule):
    """scikit-learn's bundled handwritten digits (1,797 real 8x8 grey images, no download),
    upsampled to 32x32 with nearest-neighbour and repeated on 3 channels so that the
    CIFAR-10 models take them unchanged. Pixels ``0..16`` map to ``0..255``."""

    def _load(self) -> tuple[Tensor, Tensor]:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.from_numpy(d.images).float().div(16).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
        x = torch.nn.functional.interpolate(x, size=32, mode="nearest").repeat(1, 3, 1, 1)
        return x.mul(255).round().to(torch.uint8), torch.from_numpy(d.target).long()


def _cache_dir() -> Path:
    return Path(os.environ.get("VAE_DDP_CACHE", Path.home() / ".cache" / "vae-ddp"))


def find_image_root(data_dir: str | os.PathLike) -> Path:
    """The ImageFolder root inside ``data_dir``: ``data_dir/train`` if present, else ``data_dir``.

    Raises:
        NotADirectoryError: ``data_dir`` is a file.
        FileNotFoundError: ``data_dir`` does not exist.
        ValueError: no class folder of it holds an image (``.jpg``, ``.png``, ...).
    """
    root = Path(data_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"data_dir {root} is a file, not a folder: point it at an ImageFolder tree "
                                 f"(<dir>/[train/]<class>/<image>), e.g. path/to/cifar10-jpg-subset")
    if not root.is_dir():
        raise FileNotFoundError(f"data_dir {root} does not exist: point it at an ImageFolder tree "
                                f"(<dir>/[train/]<class>/<image>), e.g. path/to/cifar10-jpg-subset")
    if (root / "train").is_dir():
        root = root / "train"
    has_images = any(p.suffix.lower() in _IMAGE_EXTS for c in root.iterdir() if c.is_dir() for p in c.iterdir())
    if not has_images:
        raise ValueError(f"data_dir {root} holds no images in class folders: expected "
                         f"<dir>/[train/]<class>/<image>.jpg|.png, e.g. path/to/cifar10-jpg-subset")
    return root


class ImageFolderDataModule(_InMemoryDataModule):
    """Any ``torchvision.datasets.ImageFolder`` tree: ``data_dir/[train/]<class>/<image>``.

    Images are read with ``torchvision.io.decode_image`` (RGB), resized to 32x32 only if
    they are not already, and cached as one ``uint8`` tensor under
    ``$VAE_DDP_CACHE`` (default ``~/.cache/vae-ddp``), keyed by the root path and the
    file list with each file's size and modification time (a changed file is read again), so
    that each DDP rank and each later run skip the decoding.

    ``data_dir`` defaults to the environment variable ``VAE_DDP_CIFAR_SUBSET``
    (``.github/scripts/cifar10-subset.sh DIR`` builds the CIFAR-10 subset there).

    Raises:
        ValueError: no ``data_dir`` and no ``VAE_DDP_CIFAR_SUBSET``; ``data_dir`` holds no images.
        FileNotFoundError: ``data_dir`` does not exist.
        NotADirectoryError: ``data_dir`` is a file.
    """

    def __init__(self, data_dir: Optional[str] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        data_dir = data_dir or os.environ.get("VAE_DDP_CIFAR_SUBSET")
        if not data_dir:
            raise ValueError("ImageFolderDataModule needs data_dir (an ImageFolder tree <dir>/[train/]<class>/<image>) "
                             "or the environment variable VAE_DDP_CIFAR_SUBSET, e.g. path/to/cifar10-jpg-subset")
        self.data_dir = data_dir
        self.root = find_image_root(data_dir)

    def prepare_data(self) -> None:
        """Decode every image once into the cache (Lightning calls this on one process per node
        before ``setup``; ``vae-ddp`` calls it before any training).

        Raises:
            ValueError: an image that cannot be decoded (names the file).
        """
        self._load()

    def _load(self) -> tuple[Tensor, Tensor]:
        from torchvision.datasets import ImageFolder
        from torchvision.io import ImageReadMode, decode_image

        folder = ImageFolder(str(self.root), loader=lambda p: p)  # paths only; decode below
        # keyed on each file's size and modification time too: a changed image is decoded (checked) again
        files = "\n".join(f"{p}:{y}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p, y in folder.samples)
        root = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:8]
        cache = _cache_dir() / f"imagefolder-{root}-{hashlib.sha1(files.encode()).hexdigest()[:16]}.pt"
        if cache.exists():
            data = torch.load(cache)
            return data["images"], data["labels"]
        imgs = []
        for path, _ in folder.samples:
            try:
                img = decode_image(path, mode=ImageReadMode.RGB)
            except (RuntimeError, ValueError, OSError) as err:  # torchvision raises RuntimeError on corrupt files
                reason = " ".join(str(err).split())[:120]
                raise ValueError(f"cannot read image {path} ({reason}): remove or replace that file, "
                                 "then rerun") from None
            if img.shape[-2:] != (32, 32):
                img = torch.nn.functional.interpolate(img[None].float(), size=(32, 32), mode="bilinear",
                                                      antialias=True)[0].round().clamp(0, 255).to(torch.uint8)
            imgs.append(img)
        images, labels = torch.stack(imgs), torch.tensor(folder.targets, dtype=torch.long)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"images": images, "labels": labels}, tmp)
        os.replace(tmp, cache)
        for old in cache.parent.glob(f"imagefolder-{root}-*.pt"):  # the same folder before a file changed
            if old != cache:
                old.unlink(missing_ok=True)
        return images, labels


class CIFAR10DataModule(_InMemoryDataModule):
    """CIFAR-10 through ``torchvision.datasets.CIFAR10`` (``download=True`` in
    ``prepare_data``, as bolts does). Needs internet the first time, or the extracted
    ``cifar-10-batches-py`` in ``data_dir``."""

    def __init__(self, data_dir: str = ".", **kwargs) -> None:
        super().__init__(**kwargs)
        self.data_dir = data_dir

    def prepare_data(self) -> None:
        """Download CIFAR-10 into ``data_dir`` unless it is there.

        Raises:
            FileNotFoundError: CIFAR-10 is not in ``data_dir`` and cannot be downloaded (no
                network, or a corrupt archive); says what to put there.
        """
        from torchvision.datasets import CIFAR10

        try:  # torchvision checks the archive's MD5 and skips the download when the files are there
            CIFAR10(self.data_dir, train=True, download=True)
        except Exception as err:  # no network, or a corrupt archive: say what to do
            raise FileNotFoundError(f"could not get CIFAR-10 into data_dir {self.data_dir} ({type(err).__name__}): put "
                                    f"cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html there "
                                    f"(torchvision extracts it), or use data='imagefolder' with an ImageFolder tree "
                                    f"as data_dir") from None

    def _load(self) -> tuple[Tensor, Tensor]:
        from torchvision.datasets import CIFAR10

        ds = CIFAR10(self.data_dir, train=True, download=False)
        return torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(ds.targets)


def make_datamodule(data: str, data_dir: Optional[str] = None, **kwargs) -> _InMemoryDataModule:
    """Build the datamodule named ``data`` (one of ``DATASETS``); ``kwargs`` go to it.

    Raises:
        ValueError: unknown name; (imagefolder) no ``data_dir``, or one without images.
        FileNotFoundError: (imagefolder) ``data_dir`` does not exist.
        NotADirectoryError: (imagefolder) ``data_dir`` is a file.
    """
    if data == "digits":
        return DigitsDataModule(**kwargs)
    if data == "cifar10":
        return CIFAR10DataModule(data_dir or ".", **kwargs)
    if data == "imagefolder":
        if not data_dir:
            raise ValueError("data='imagefolder' needs data_dir, an ImageFolder tree such as "
                             "path/to/cifar10-jpg-subset")
        return ImageFolderDataModule(data_dir, **kwargs)
    raise ValueError(f"unknown data {data!r}: use one of {', '.join(DATASETS)}")


def check_data(data: str, data_dir: Optional[str] = None) -> None:
    """Check before any training that the data of ``data`` can be read: every image of an
    ImageFolder decodes (and is cached), CIFAR-10 is in ``data_dir`` or can be downloaded.

    Raises:
        ValueError: unknown ``data``, no or an empty ``data_dir``, an image that cannot be decoded.
        FileNotFoundError: ``data_dir`` does not exist, or CIFAR-10 is not there and cannot be downloaded.
        NotADirectoryError: ``data_dir`` is a file.
    """
    if data == "digits":
        return
    make_datamodule(data, data_dir).prepare_data()
