"""Real architectures from maintained libraries, each in the minimal LightningModule its users write.

The models are torchvision's, timm's, Hugging Face transformers' and segmentation_models_pytorch's
(the DCGAN, which no library ships, is adapted from PyTorch's DCGAN tutorial: 32x32 images, four
layers, logits), in tiny configurations that train on CPU; the data are torchvision's `FakeData`
images (a fixed image per index) and short token sequences. A datamodule's `batch_size` is its
loader's batch: the audit sets it to the global batch size on one device and to the global batch
size divided by the world size on each DDP rank.
`examples/audit_gallery.py` runs `vae-ddp audit` on each pair of `GALLERY`:

    vae-ddp audit --model examples/gallery.py:ResNet18 --data examples/gallery.py:Images

The libraries are imported by the classes that use them (`pip install -e ".[gallery]"`).
"""

from __future__ import annotations

from typing import Optional

import torch
from pytorch_lightning import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

# ------------------------------------------------------------------ data


class Images(LightningDataModule):
    """`n` images `(3, size, size)` in [0, 1] with a class label in `0..9` (torchvision's
    `FakeData`: the image of index i is fixed); `views=2` gives each sample two random views
    (SimCLR's crop and flip, drawn in `__getitem__` as torchvision's transforms draw), `seeded=True`
    draws them per sample (`vae_ddp.fixes.SeededAugmentation`)."""

    def __init__(self, batch_size: int = 8, n: int = 32, size: int = 32, views: int = 1, shuffle: bool = True,
                 seeded: bool = False) -> None:
        super().__init__()
        self.batch_size, self.n, self.size, self.views, self.shuffle = batch_size, n, size, views, shuffle
        self.seeded = seeded

    def setup(self, stage: str) -> None:
        from torchvision import datasets, transforms

        if self.views == 1:
            self.train_set = datasets.FakeData(self.n, (3, self.size, self.size), 10, transforms.ToTensor())
        else:
            view = transforms.Compose([transforms.RandomResizedCrop(self.size, scale=(0.5, 1.0)),
                                       transforms.RandomHorizontalFlip(), transforms.ToTensor()])
            if self.seeded:  # the fix: sample i's views drawn from generators seeded with (seed, epoch, i)
                from vae_ddp.fixes import SeededAugmentation

                images = datasets.FakeData(self.n, (3, self.size, self.size), 10)
                self.train_set = SeededAugmentation(images, TwoViews(view))
            else:
                self.train_set = datasets.FakeData(self.n, (3, self.size, self.size), 10, TwoViews(view))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle)


class TwoViews:
    """Two independent draws of a random transform of one image (SimCLR's positive pair)."""

    def __init__(self, transform) -> None:
        self.transform = transform

    def __call__(self, image):
        return torch.stack([self.transform(image), self.transform(image)])


class Masks(Images):
    """`FakeData` images with a segmentation target: `mask: (1, size, size)`, 1 where the image is bright."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.train_set = _WithMask(self.train_set)


class _WithMask(Dataset):
    def __init__(self, images) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        image, _ = self.images[i]
        return image, (image.mean(0, keepdim=True) > 0.5).float()


def tiny_tokenizer(vocab: int = 60):
    """A word-level tokenizer of `vocab` words plus BERT's five special tokens, built offline
    (`tokenizers.models.WordLevel` in a `transformers.PreTrainedTokenizerFast`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = {w: i for i, w in enumerate(special + [f"w{i}" for i in range(vocab)])}
    tok = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class Text(LightningDataModule):
    """`n` sentences of 4 to 16 words (a fixed draw), tokenized and padded per batch by Hugging Face's
    `DataCollatorForLanguageModeling`: `mlm=False` gives causal-LM labels (-100 on padding), `mlm=True`
    masks 15% of the tokens at random in the loader's `collate_fn`, as BERT is pretrained."""

    def __init__(self, batch_size: int = 8, n: int = 32, mlm: bool = False, shuffle: bool = True,
                 pad_to_multiple_of: Optional[int] = None) -> None:
        super().__init__()
        self.batch_size, self.n, self.mlm, self.shuffle = batch_size, n, mlm, shuffle
        self.pad_to_multiple_of = pad_to_multiple_of

    def setup(self, stage: str) -> None:
        self.tokenizer = tiny_tokenizer()
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, 17, (self.n,), generator=g).tolist()
        words = [" ".join(f"w{int(w)}" for w in torch.randint(0, 60, (k,), generator=g)) for k in lengths]
        self.train_set = [self.tokenizer(s) for s in words]

    def train_dataloader(self) -> DataLoader:
        from transformers import DataCollatorForLanguageModeling

        collate = DataCollatorForLanguageModeling(self.tokenizer, mlm=self.mlm,
                                                  pad_to_multiple_of=self.pad_to_multiple_of)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=collate)


# ------------------------------------------------------------------ vision


class Classifier(LightningModule):
    """Cross entropy of a classifier on `(x: (B, 3, H, W), y: (B,))`, SGD with momentum."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class ResNet18(Classifier):
    """torchvision's ResNet-18 (BatchNorm after every convolution)."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.net = resnet18(num_classes=10)


class MobileNetV3(Classifier):
    """torchvision's MobileNetV3-Small (BatchNorm, and dropout before the last layer)."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import mobilenet_v3_small

        self.net = mobilenet_v3_small(num_classes=10)


class ViT(Classifier):
    """timm's Vision Transformer, 2 blocks, with stochastic depth (drop-path: each residual branch
    is zeroed for a random part of the samples; timm's linear schedule gives the first block 0
    and the second ``drop_path_rate``) and AdamW."""

    def __init__(self, drop_path_rate: float = 0.1) -> None:
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.net = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10,
                                     drop_path_rate=drop_path_rate)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class UNet(LightningModule):
    """segmentation_models_pytorch's U-Net with a ResNet-18 encoder (BatchNorm), binary masks, Adam."""

    def __init__(self) -> None:
        super().__init__()
        import segmentation_models_pytorch as smp

        self.net = smp.Unet("resnet18", encoder_weights=None, classes=1, decoder_channels=(64, 32, 16, 16, 8))

    def training_step(self, batch, batch_idx):
        x, mask = batch
        loss = F.binary_cross_entropy_with_logits(self.net(x), mask)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class SimCLR(LightningModule):
    """SimCLR (Chen et al. 2020): a torchvision ResNet-18 whose last layer is a linear projection;
    the NT-Xent loss takes every other view of the *global* batch as a negative, gathered with
    gradients (`self.all_gather(z, sync_grads=True)`)."""

    def __init__(self, temperature: float = 0.5) -> None:
        super().__init__()
        from torchvision.models import resnet18

        self.temperature = temperature
        self.net = resnet18(num_classes=32)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    # --8<-- [start:simclr]
    def training_step(self, batch, batch_idx):
        views, _ = batch  # views: (b, 2, 3, H, W), two random views of each image
        b = len(views)
        z = F.normalize(self.net(torch.cat([views[:, 0], views[:, 1]])), dim=-1)  # (2b, 32): first views, then second
        every = self.all_gather(z, sync_grads=True)  # (N, 2b, 32) under DDP, z itself on one device
        keys = every.flatten(0, 1) if every.dim() == 3 else every  # (2B, 32): the global batch's views
        start = self.global_rank * 2 * b  # where this rank's views start among the keys
        sim = z @ keys.T / self.temperature  # (2b, 2B)
        own = torch.arange(2 * b, device=z.device) + start
        sim[torch.arange(2 * b, device=z.device), own] = float("-inf")  # a view is not its own negative
        positives = torch.cat([own[b:], own[:b]])  # the other view of the same image
        return F.cross_entropy(sim, positives)  # a mean over 2b queries; DDP averages the ranks' means
    # --8<-- [end:simclr]


class SimCLRTransposed(SimCLR):
    """The same loss with the views of the global batch laid out view by view, by a transpose of
    the gathered embeddings: the gradient that reaches `all_gather` is then not contiguous, which
    torch's autograd `all_gather` sends back wrongly over gloo (see the page)."""

    def training_step(self, batch, batch_idx):
        views, _ = batch  # views: (b, 2, 3, H, W)
        z = F.normalize(self.net(views.flatten(0, 1)), dim=-1).unflatten(0, (-1, 2))  # (b, 2, 32)
        every = self.all_gather(z, sync_grads=True)  # (N, b, 2, 32) under DDP, z on one device
        every = every.flatten(0, 1) if every.dim() == 4 else every  # (B, 2, 32): the global batch
        keys = every.transpose(0, 1).flatten(0, 1)  # (2B, 32): first views, then second views
        queries = z.transpose(0, 1).flatten(0, 1)  # (2b, 32)
        b, big = len(z), len(every)
        own = (torch.cat([torch.arange(b, device=z.device), torch.arange(b, device=z.device) + big])
               + self.global_rank * b)
        sim = queries @ keys.T / self.temperature
        sim[torch.arange(2 * b, device=z.device), own] = float("-inf")
        return F.cross_entropy(sim, torch.cat([own[b:], own[:b]]))


class DCGAN(LightningModule):
    """The DCGAN of PyTorch's tutorial (Radford et al. 2016), adapted to 32x32 images: transposed
    convolutions with BatchNorm, a noise vector `z: (b, nz)` drawn in `training_step`, two Adam
    optimizers with manual optimization, the discriminator's step first as in the tutorial."""

    def __init__(self, nz: int = 16, width: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.nz = nz
        w = width
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(nz, w * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(w * 4), nn.ReLU(True),
            nn.ConvTranspose2d(w * 4, w * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(w * 2), nn.ReLU(True),
            nn.ConvTranspose2d(w * 2, w, 4, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(True),
            nn.ConvTranspose2d(w, 3, 4, 2, 1, bias=False), nn.Tanh())
        self.discriminator = nn.Sequential(
            nn.Conv2d(3, w, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
            nn.Conv2d(w, w * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(w * 2), nn.LeakyReLU(0.2, True),
            nn.Conv2d(w * 2, w * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(w * 4), nn.LeakyReLU(0.2, True),
            nn.Conv2d(w * 4, 1, 4, 1, 0, bias=False), nn.Flatten())

    def training_step(self, batch, batch_idx):
        real, _ = batch
        real = real * 2 - 1
        opt_g, opt_d = self.optimizers()
        z = self.noise_vector(real)
        fake = self.generator(z)
        ones = torch.ones(len(real), 1, dtype=real.dtype, device=real.device)
        zeros = torch.zeros_like(ones)
        loss_d = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        loss_g = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.log_dict({"loss_d": loss_d, "loss_g": loss_g}, sync_dist=True, batch_size=len(real))

    def noise_vector(self, real):
        return torch.randn(len(real), self.nz, 1, 1, dtype=real.dtype, device=real.device)

    def configure_optimizers(self):
        betas = (0.5, 0.999)
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=betas),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=betas))


# --8<-- [start:dcgan-noise]
class DCGANGlobalNoise(DCGAN):
    """The DCGAN with its one-line fix: `z` drawn for the global batch, this rank's rows
    (`vae_ddp.fixes.global_batch_draw`; torch's generator when no `GlobalBatchRandomness` runs)."""

    def noise_vector(self, real):
        from vae_ddp.fixes import global_batch_draw

        return global_batch_draw(torch.randn, (len(real), self.nz, 1, 1), real.dtype, real.device)
# --8<-- [end:dcgan-noise]


class VQVAE(LightningModule):
    """A VQ-VAE (van den Oord et al., 2017, arXiv:1711.00937) whose codebook is learned by
    exponential moving averages of the batch's assignments (the paper's appendix A.1; Sonnet's
    `VectorQuantizerEMA`): `forward` writes the codebook buffers in training mode, from the
    batch it sees; the straight-through estimator and the commitment loss (beta 0.25), Adam."""

    def __init__(self, codes: int = 16, dim: int = 8, decay: float = 0.9) -> None:
        super().__init__()
        self.codes, self.dim, self.decay = codes, dim, decay
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, dim, 4, 2, 1))
        self.dec = nn.Sequential(nn.ConvTranspose2d(dim, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 3, 4, 2, 1))
        self.register_buffer("codebook", torch.randn(codes, dim))
        self.register_buffer("cluster_size", torch.ones(codes))
        self.register_buffer("embed_sum", self.codebook.clone())

    def quantize(self, z):
        """``z: (B, dim, H, W)`` -> (the straight-through quantized ``z``, the codes it took)."""
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        idx = torch.cdist(flat, self.codebook).argmin(1)
        q = self.codebook[idx].view(b, h, w, d).permute(0, 3, 1, 2)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, self.codes).to(flat.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(onehot.T @ flat, alpha=1 - self.decay)
                self.codebook.copy_(self.embed_sum / (self.cluster_size.unsqueeze(1) + 1e-5))
        return z + (q - z).detach(), q

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z = self.enc(x)
        zq, q = self.quantize(z)
        loss = F.mse_loss(self.dec(zq), x) + 0.25 * F.mse_loss(z, q.detach())
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# ------------------------------------------------------------------ language


class GPT2(LightningModule):
    """Hugging Face's GPT-2, 2 layers (dropout 0.1 in attention, residuals and embeddings), the
    causal-LM loss the model returns (a mean over the batch's unpadded tokens), AdamW."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.net = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                   bos_token_id=2, eos_token_id=3, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        loss = self.net(**batch).loss
        self.log("train_loss", loss, sync_dist=True, batch_size=len(batch["input_ids"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# --8<-- [start:gpt2-fixed]
class GPT2Fixed(GPT2):
    """GPT-2 with the changes the audit asks for: no attention dropout (`attn_pdrop=0`: Hugging Face
    draws it inside the attention function with `torch.nn.functional.dropout` or in
    `scaled_dot_product_attention`, where no layer can be served; the residual and embedding
    dropout are `nn.Dropout` layers, which `GlobalBatchRandomness` serves), the loss over the
    global batch's token count (`global_token_cross_entropy`), and the data padded to one length
    (`Text(pad_to_multiple_of=32)`: each rank's rows have the shape they have on one device, so
    their dropout masks are the global batch's)."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        from transformers import GPT2Config, GPT2LMHeadModel

        self.net = GPT2LMHeadModel(GPT2Config(vocab_size=65, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                              bos_token_id=2, eos_token_id=3, pad_token_id=0, attn_pdrop=0.0))

    def training_step(self, batch, batch_idx):
        from vae_ddp.fixes import global_token_cross_entropy

        logits = self.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = global_token_cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        self.log("train_loss", loss, sync_dist=True, batch_size=len(batch["input_ids"]))
        return loss
# --8<-- [end:gpt2-fixed]


class GPT2ScaledLearningRate(GPT2Fixed):
    """`GPT2Fixed` with the "linear scaling rule" applied at the same global batch: AdamW's learning
    rate multiplied by `self.trainer.world_size`."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3 * self.trainer.world_size)


class GPT2OneCycle(GPT2Fixed):
    """`GPT2Fixed` with a OneCycleLR whose length is counted from the loader, a common pattern:
    `len(self.trainer.datamodule.train_dataloader()) * self.trainer.max_epochs` (under DDP the
    loader is per-device: N times the batches, a schedule N times as long)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total = len(self.trainer.datamodule.train_dataloader()) * self.trainer.max_epochs
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class BertMLM(GPT2):
    """Hugging Face's BERT for masked LM, 2 layers; the loss is the mean over the masked tokens."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        from transformers import BertConfig, BertForMaskedLM

        self.net = BertForMaskedLM(BertConfig(vocab_size=65, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=64, max_position_embeddings=32))


#: name -> (model class, data class, data init args, Trainer arguments): what the gallery audits
GALLERY = {
    "ResNet-18": ("ResNet18", "Images", {}, {}),
    "MobileNetV3": ("MobileNetV3", "Images", {}, {}),
    "ViT (drop-path)": ("ViT", "Images", {}, {}),
    "U-Net": ("UNet", "Masks", {}, {}),
    "SimCLR": ("SimCLR", "Images", {"views": 2}, {}),
    "SimCLR, views seeded per sample": ("SimCLR", "Images", {"views": 2, "seeded": True}, {}),
    "SimCLR, seeded, keys by a transpose": ("SimCLRTransposed", "Images", {"views": 2, "seeded": True}, {}),
    "DCGAN": ("DCGAN", "Images", {}, {"strategy": "ddp_find_unused_parameters_true"}),
    "DCGAN, z for the global batch": ("DCGANGlobalNoise", "Images", {},
                                      {"strategy": "ddp_find_unused_parameters_true"}),
    "GPT-2": ("GPT2", "Text", {}, {}),
    "GPT-2, global token mean, no attention dropout": ("GPT2Fixed", "Text", {"pad_to_multiple_of": 32}, {}),
    "GPT-2, as above, padded per batch": ("GPT2Fixed", "Text", {}, {}),
    "BERT (masked LM)": ("BertMLM", "Text", {"mlm": True}, {}),
    "VQ-VAE, EMA codebook": ("VQVAE", "Images", {}, {}),
    "GPT-2 fixed, learning rate x world size": ("GPT2ScaledLearningRate", "Text", {"pad_to_multiple_of": 32}, {}),
    "GPT-2 fixed, OneCycleLR sized by the loader": ("GPT2OneCycle", "Text", {"pad_to_multiple_of": 32},
                                                    {"max_epochs": 2}),
    "GPT-2 fixed, bf16-mixed": ("GPT2Fixed", "Text", {"pad_to_multiple_of": 32}, {"precision": "bf16-mixed"}),
}
