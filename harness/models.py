"""Models as folders: any local Hugging Face folder of an architecture the engine supports is a model, and the zoo's
names are shortcuts to the folders it prepares, through the same code. A verb puts the model arguments on its parser
(add_model_arguments: --model NAME, --model-path DIR, --name, and --golden-dir where it reads goldens) and turns them
into ModelRefs (resolve_models, resolve_model), refusing in one line what cannot run before any work starts."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, List, Sequence

from harness import UserError, zoo

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
TOKENIZER_MAIN = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer is saved as one of these
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ModelRef:
    """A model the harness runs: its name (goldens and reports are filed under it), its folder, and where its goldens
    live (golden_root/<name>/<device>-<dtype>/). zoo: named by the zoo (--model NAME says it on a command line)."""

    name: str
    folder: Path
    has_weights: bool
    golden_root: Path = GOLDEN_DIR
    zoo: bool = False

    @cached_property
    def config(self) -> "ModelConfig":
        from engine.models.config import ModelConfig
        from engine.utils.hf import cached_load_hf_config

        return ModelConfig.from_hf(cached_load_hf_config(str(self.folder)))

    @property
    def is_moe(self) -> bool:
        return self.config.is_moe

    @property
    def has_tokenizer(self) -> bool:
        return any((self.folder / f).is_file() for f in TOKENIZER_MAIN)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (in any of the places transformers reads one from)."""
        if any((self.folder / f).is_file() for f in CHAT_TEMPLATE_FILES):
            return True
        if (self.folder / "additional_chat_templates").is_dir():
            return True
        cfg = self.folder / "tokenizer_config.json"
        return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))

    def weights_sha256(self) -> str:
        return zoo.cached_weights_sha256(self.folder)

    def tokenizer_sha256(self) -> str:
        return zoo.tokenizer_sha256(self.folder)

    @property
    def args(self) -> str:
        """The command-line arguments that name this model."""
        return f"--model {self.name}" if self.zoo else f"--model-path {self.folder}" + (
            f" --name {self.name}" if self.name != self.folder.name else "")

    @property
    def golden_args(self) -> str:
        """--golden-dir, when its goldens live elsewhere than the repository's golden/."""
        return "" if self.golden_root == GOLDEN_DIR else f" --golden-dir {self.golden_root}"


def _supported() -> str:
    from engine.models.config import ARCHITECTURES

    return ", ".join(sorted(ARCHITECTURES))


def from_folder(folder: Path | str, name: str | None = None, golden_root: Path | None = None,
                is_zoo: bool = False) -> ModelRef:
    """The model in a folder, once its config names an architecture (and options) the engine supports."""
    from engine.models.config import ARCHITECTURES, ModelConfig
    from engine.utils.hf import cached_load_hf_config

    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give --model-path the folder of a Hugging Face model "
                        "(config.json, *.safetensors and the tokenizer's files, as save_pretrained writes them)")
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json; give the folder save_pretrained wrote the model to")
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except ValueError as e:
        raise UserError(f"{folder}/config.json is not JSON ({e}); save the model's config again") from e
    if not archs or archs[0] not in ARCHITECTURES:
        what = f"architecture {archs[0]}" if archs else "no architecture (config.json lacks \"architectures\")"
        raise UserError(f"{folder} has {what}, which the engine does not run; supported: {_supported()}")
    try:
        ModelConfig.from_hf(cached_load_hf_config(str(folder)))
    except ValueError as e:
        raise UserError(f"{folder}: {e}; the engine cannot run this configuration") from e
    return ModelRef(name or folder.name, folder, any(folder.glob("*.safetensors")), golden_root or GOLDEN_DIR,
                    is_zoo)


def zoo_model(name: str, golden_root: Path | None = None) -> ModelRef:
    """A zoo model: its folder, prepared first if needed."""
    if name not in zoo.MODELS:
        raise UserError(f"unknown model {name!r}; the zoo has: {', '.join(zoo.MODELS)}; or give a model's folder "
                        "with --model-path DIR")
    return from_folder(zoo.path(name), name, golden_root, is_zoo=True)


def as_model(model: ModelRef | str, golden_root: Path | None = None) -> ModelRef:
    """A ModelRef as is (with golden_root, if given, as its goldens' root), or a zoo name's."""
    ref = model if isinstance(model, ModelRef) else zoo_model(model)
    return ref if golden_root is None else dataclasses.replace(ref, golden_root=Path(golden_root))


def name_of(model: ModelRef | str) -> str:
    return model if isinstance(model, str) else model.name


def require(ref: ModelRef, weights: bool = True, tokenizer: bool = True, verb: str = "this verb") -> ModelRef:
    """Refuse a model that lacks what the verb needs: real weights, a tokenizer."""
    if weights and not ref.has_weights:
        other = [f.name for f in ref.folder.glob("*.bin")] + [f.name for f in ref.folder.glob("*.pt")]
        hint = f" ({', '.join(other)} are not read: save the weights as safetensors)" if other else ""
        raise UserError(f"{ref.name} ({ref.folder}) has no weights (no *.safetensors file){hint}; {verb} needs a model "
                        "with weights: save them into the folder with save_pretrained (bench alone runs a folder "
                        "without weights, on dummy weights)")
    if tokenizer and not ref.has_tokenizer:
        raise UserError(f"{ref.name} ({ref.folder}) has no tokenizer (none of {', '.join(TOKENIZER_MAIN)}); save the "
                        "tokenizer into the folder too (tokenizer.save_pretrained)")
    return ref


def describe(ref: ModelRef) -> str:
    """One line: what the engine will run (from its own reading of the config) and the model's identity."""
    c = ref.config
    parts = [f"{c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_qo_heads} heads and "
             f"{c.num_kv_heads} KV heads of {c.head_dim}, vocabulary {c.vocab_size}, "
             f"{'tied' if c.tie_word_embeddings else 'untied'} LM head, RoPE base {c.rotary_config.base:g}"]
    if c.sliding_window is not None:
        parts.append(f"sliding window {c.sliding_window} on {c.layer_types.count('sliding')} of {c.num_layers} layers")
    if c.is_moe:
        parts.append(f"{c.num_experts} experts, top {c.num_experts_per_tok}")
    weights = f"weights sha256 {ref.weights_sha256()}" if ref.has_weights else "no weights (bench only)"
    tok = ("tokenizer with a chat template" if ref.has_chat_template else "tokenizer without a chat template") \
        if ref.has_tokenizer else "no tokenizer"
    return f"{ref.name} ({ref.folder}): {'; '.join(parts)}; {weights}; {tok}"


# --------------------------------------------------------------------------------------------------------- CLI
def add_model_arguments(p: argparse.ArgumentParser, default_help: str, many: bool = True, golden: bool = False,
                        flag: str = "--model") -> None:
    """--model NAME (a zoo name) and --model-path DIR (any folder), repeatable when many; --name; --golden-dir when
    the verb reads or writes goldens."""
    action = "append" if many else "store"
    p.add_argument(flag, dest="model", action=action, choices=list(zoo.MODELS), metavar="NAME",
                   help=f"a model of the zoo ({', '.join(zoo.MODELS)}); default: {default_help}")
    p.add_argument("--model-path", action=action, type=Path, metavar="DIR",
                   help="a local Hugging Face model folder (config.json, *.safetensors, tokenizer) of an architecture "
                        f"the engine runs: {_supported()}")
    p.add_argument("--name", help="the name of the --model-path model, under which its goldens and reports go "
                                  "(default: the folder's name)")
    if golden:
        p.add_argument("--golden-dir", type=Path, metavar="DIR",
                       help="where goldens live: DIR/<name>/<device>-<dtype>/ (default: the repository's golden/)")


def resolve_models(args: argparse.Namespace, defaults: Sequence[str], weights: bool = True, tokenizer: bool = True,
                   verb: str = "this verb") -> List[ModelRef]:
    """The models the arguments name (zoo names first, then folders), else the defaults (zoo names)."""
    names, paths = _listed(args.model), _listed(getattr(args, "model_path", None))
    if args.name is not None and len(paths) != 1:
        raise UserError("--name names the model of --model-path; give it with exactly one --model-path")
    root = getattr(args, "golden_dir", None)
    refs = [zoo_model(n, root) for n in names] + [from_folder(p, args.name, root) for p in paths]
    refs = refs or [zoo_model(n, root) for n in defaults]
    seen = set()
    for ref in refs:
        if ref.name in seen:
            raise UserError(f"two models are named {ref.name!r}; give one of them another name with --name")
        seen.add(ref.name)
        require(ref, weights, tokenizer, verb)
    return refs


def resolve_model(args: argparse.Namespace, default: str, weights: bool = True, tokenizer: bool = True,
                  verb: str = "this verb") -> ModelRef:
    """The one model of a verb that takes one."""
    if args.model is not None and args.model_path is not None:
        raise UserError("give either --model or --model-path, not both")
    return resolve_models(args, [default], weights, tokenizer, verb)[0]


def _listed(value: object) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]
