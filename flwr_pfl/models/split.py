"""A user's own model as body + head(s): the adapter that lets every client take a plain nn.Module.

Personalized algorithms move parts of a model around: FedRep and FedPer share the body and keep
the head on the client, pFedFDA writes a generative head into the head, FedDAR has one head per
domain. :class:`~flwr_pfl.models.base.EncoderHeadModel` builds that shape from an encoder; a
Flower user's model already has it, implicitly (quickstart-pytorch's ``Net`` ends in ``fc3``).
:func:`split_model` names the head and wraps the model in a :class:`HeadSplit`, which offers the
interface the clients use (parameter groups through :meth:`HeadSplit.in_head`, ``features()``,
``head_outputs()``, ``heads``, ``num_heads``) while keeping the user's modules, weights and
``forward``. Every client accepts ``head=`` and does this itself.
"""

from __future__ import annotations

import copy
import difflib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Literal, Union

import torch
from torch import nn

from flwr_pfl.errors import ConfigError
from flwr_pfl.models.base import EncoderHeadModel, route_heads

#: how a head is named: a module name ("fc3"), the module itself, parameter-name prefixes
#: (["fc2", "fc3"]) or a predicate on the model's state_dict keys
HeadSpec = Union[str, nn.Module, Sequence[str], Callable[[str], bool]]
#: what an algorithm needs to know of the head: nothing (the whole model moves), which
#: parameters are the head (parameter groups ``body`` / ``heads``), or the head as one module
#: (``features()``, ``head_outputs()``, ``heads``)
HeadRequirement = Literal["none", "parameters", "module"]

_MODULE = "module."
#: where the heads 1..M-1 of a several-head model are in its state_dict (head 0 is the user's own)
EXTRA_HEADS = "extra_heads."
_EXTRA = EXTRA_HEADS
_LISTED = 40


class _HeadReached(Exception):
    """Raised by the head's forward pre-hook: stops the user's forward where the head starts."""

    def __init__(self, inputs: tuple) -> None:
        super().__init__("the head was reached")
        self.inputs = inputs


def _stop_at_head(module: nn.Module, inputs: tuple) -> None:
    raise _HeadReached(inputs)


def module_names(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` that hold parameters (the candidate heads)."""
    return [name for name, m in model.named_modules() if name and any(True for _ in m.parameters())]


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")


def _suggestion(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=3)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _matches(key: str, prefix: str) -> bool:
    """``prefix`` names ``key`` or a module above it (``fc3`` and ``fc3.`` match ``fc3.weight``)."""
    prefix = prefix.rstrip(".")
    return key == prefix or key.startswith(prefix + ".")


def _describe(head: HeadSpec | None) -> str:
    if head is None or isinstance(head, str):
        return repr(head)
    if isinstance(head, nn.Module):
        return f"a {type(head).__name__} module"
    if callable(head):
        return f"the predicate {getattr(head, '__name__', type(head).__name__)}"
    return repr(list(head))


def _covering_module(model: nn.Module, keys: Sequence[str], head_keys: Sequence[str]) -> str | None:
    """The outermost submodule whose state_dict keys are exactly ``head_keys``, if any."""
    wanted = set(head_keys)
    for name, _ in model.named_modules():
        if name and {k for k in keys if _matches(k, name)} == wanted:
            return name
    return None


def _resolve(model: nn.Module, head: HeadSpec | None, keys: list[str]) -> tuple[list[str], str | None]:
    """(the head's state_dict keys, the head's module name or None) for ``head``."""
    if head is None:
        return [], None
    kind = type(model).__name__
    candidates = module_names(model)
    name: str | None
    if isinstance(head, nn.Module):
        name = next((n for n, m in model.named_modules() if m is head), None)
        if name is None or name == "":
            what = "the whole model" if name == "" else f"not a submodule of {kind}"
            raise ConfigError(
                f"the head module given ({type(head).__name__}) is {what}; name one of {kind}'s "
                f"modules instead: {_listing(candidates)}"
            )
        head_keys = [k for k in keys if _matches(k, name)]
    elif isinstance(head, str):
        name = head.rstrip(".")
        if not name or name not in dict(model.named_modules()):
            raise ConfigError(
                f"head={head!r} is not a module of {kind}{_suggestion(name, candidates)}; its "
                f"modules with parameters are: {_listing(candidates)}"
            )
        head_keys = [k for k in keys if _matches(k, name)]
    elif isinstance(head, Sequence) and all(isinstance(p, str) for p in head):
        if not head:
            raise ConfigError("head=[] names no parameters; give at least one parameter-name prefix")
        for prefix in head:
            if not any(_matches(k, prefix) for k in keys):
                raise ConfigError(
                    f"head prefix {prefix!r} matches no parameter of {kind}"
                    f"{_suggestion(prefix.rstrip('.'), candidates)}; its parameter names are: {_listing(keys)}"
                )
        head_keys = [k for k in keys if any(_matches(k, p) for p in head)]
        name = _covering_module(model, keys, head_keys)
    elif callable(head):
        head_keys = [k for k in keys if head(k)]
        name = _covering_module(model, keys, head_keys) if head_keys else None
    else:
        raise TypeError(
            f"head must be a module name, a module, a list of parameter-name prefixes or a "
            f"predicate on parameter names; got {type(head).__name__}"
        )
    if not head_keys:
        raise ConfigError(
            f"the head {_describe(head)} holds no parameters of {kind}; its modules with "
            f"parameters are: {_listing(candidates)}"
        )
    if len(head_keys) == len(keys):
        raise ConfigError(
            f"the head {_describe(head)} covers every parameter of {kind}, which leaves no body; "
            f"name its final layer(s) only (modules: {_listing(candidates)})"
        )
    return head_keys, name


def _linear_widths(head: nn.Module) -> tuple[int, int] | None:
    """(input width of the first nn.Linear, output width of the last) inside ``head``."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return (linears[0].in_features, linears[-1].out_features) if linears else None


class HeadSplit(nn.Module):
    """A user's model split into body and head(s), with its modules and weights untouched.

    ``forward(x)`` is the user's model's own forward (with several heads: each sample's own
    head on ``features(x)``, picked by its domain label). ``features(x)`` is what the model
    feeds its head (the forward stops there); ``head_outputs(z, domain)`` applies the heads.
    These two need the head to be one module whose output is the model's output (checked on
    the first call, with a message saying what does not fit).

    ``state_dict`` keys are the user's own under ``module.`` (``module.fc3.weight``); with
    several heads, heads 1..M-1 follow under ``extra_heads.<m - 1>.`` (head 0 is the user's own
    head module). ``state_dict`` order, which is the wire order, is the body's entries in the
    user's order, then head 0, then heads 1..M-1, whatever order the user's modules were
    registered in (strategies find the heads at the end). :meth:`user_state_dict` gives the
    user's own keys and order back.

    Args:
        model: the user's model; its forward takes one input batch.
        head: which part is the head. A module name (``"fc3"``; nested modules dotted,
            ``"classifier.2"``), the head module itself (``model.fc3``), a list of
            parameter-name prefixes (``["fc2", "fc3"]``; each matches itself and the names below
            it) or a predicate on the model's state_dict keys (``lambda k: k.startswith("fc3.")``).
            Prefixes and predicates that cover exactly one module name that module. None: no
            head (enough for algorithms that move the whole model: FedAvg, Local, fine-tuning,
            FedGP/FedDA).
        num_heads: heads M (one per domain, as FedDAR needs); heads 1..M-1 are copies of the
            user's head module, with its weights.
        feature_dim, num_outputs: the head's input and output widths; by default read from the
            head's first and last ``nn.Linear``.

    Raises:
        ConfigError: the head names nothing in the model (the message lists its modules),
            covers the whole model, or several heads are asked of a head that is not one module.
    """

    def __init__(
        self,
        model: nn.Module,
        head: HeadSpec | None = None,
        *,
        num_heads: int = 1,
        feature_dim: int | None = None,
        num_outputs: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if is_split(model):
            raise ConfigError(
                f"the model is already split into body and head(s) (a {type(model).__name__}); "
                "pass it as it is, without head="
            )
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.module = model
        keys = list(model.state_dict())
        head_keys, self.head_name = _resolve(model, head, keys)
        self._head_keys = frozenset(head_keys)
        self._head_text = _describe(head)
        if num_heads > 1 and self.head_name is None:
            raise ConfigError(
                f"building {num_heads} heads as copies of the head needs the model's head as one "
                f"module; the head {self._head_text} is not one module of {type(model).__name__}. "
                f"Name one (head='<name>'; modules: {_listing(module_names(model))})"
            )
        user_head = model.get_submodule(self.head_name) if self.head_name is not None else None
        self.extra_heads = nn.ModuleList(copy.deepcopy(user_head) for _ in range(num_heads - 1))
        widths = _linear_widths(user_head) if user_head is not None else None
        self._feature_dim = feature_dim or (widths[0] if widths else None)
        self._num_outputs = num_outputs or (widths[1] if widths else None)
        self._checked = False  # features() checked against forward

    def extra_repr(self) -> str:
        return f"head={self.head_name or self._head_text}, num_heads={self.num_heads}"

    # ---------------------------------------------------------------- the interface clients use
    @property
    def splits_features(self) -> bool:
        """Whether ``features()`` / ``head_outputs()`` / ``heads`` are available (the head is one module)."""
        return self.head_name is not None

    @property
    def num_heads(self) -> int:
        return 1 + len(self.extra_heads)

    @property
    def heads(self) -> nn.ModuleList:
        """Head 0 (the user's own head module) and its copies 1..M-1."""
        return nn.ModuleList([self._head_module("heads"), *self.extra_heads])

    @property
    def feature_dim(self) -> int:
        """Width of the features the head takes."""
        if self._feature_dim is None:
            raise ConfigError(self._unknown_width("feature_dim", "input"))
        return self._feature_dim

    @property
    def num_outputs(self) -> int:
        """Width of the head's output (classes, or regression targets)."""
        if self._num_outputs is None:
            raise ConfigError(self._unknown_width("num_outputs", "output"))
        return self._num_outputs

    def in_head(self, key: str, index: int | None = None) -> bool:
        """Whether ``state_dict`` key ``key`` belongs to head ``index`` (None: to any head)."""
        if key.startswith(_MODULE):
            return index in (None, 0) and key[len(_MODULE):] in self._head_keys
        if key.startswith(_EXTRA):
            return index is None or (index >= 1 and key.startswith(f"{_EXTRA}{index - 1}."))
        return False

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """What the model feeds its head for ``x``: shape (B, feature_dim).

        Raises:
            ConfigError: the head is not one module, is not called exactly once, is not the last
                step of forward, or takes something other than one (B, feature_dim) tensor.
        """
        head = self._head_module("features()")
        if not self._checked:
            self._check_head_is_last(head, x)
        handle = head.register_forward_pre_hook(_stop_at_head)
        try:
            self.module(x)
        except _HeadReached as reached:
            inputs = reached.inputs
        else:
            raise ConfigError(self._never_called())
        finally:
            handle.remove()
        return self._checked_features(inputs)

    def head_outputs(self, features: torch.Tensor, domain: torch.Tensor | None) -> torch.Tensor:
        """Each sample's own head on its features, shape (B, num_outputs)."""
        return route_heads(self.heads, features, domain)

    def forward(self, x: torch.Tensor, domain: torch.Tensor | None = None) -> torch.Tensor:
        if not self.extra_heads:
            return self.module(x)
        return self.head_outputs(self.features(x), domain)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The state as ``nn.Module.state_dict`` gives it, with the head entries moved last."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for key in [k for k in state if k.startswith(prefix) and self.in_head(k[len(prefix):])]:
            state[key] = state.pop(key)
        return state

    def user_state_dict(self, head: int = 0) -> OrderedDict[str, torch.Tensor]:
        """The user's model's own ``state_dict`` (its keys and order), with head ``head``'s
        weights in the head's place (head 0 is the user's own head module)."""
        state = self.module.state_dict()
        if head == 0:
            return state
        if not 0 < head < self.num_heads:
            raise ValueError(f"head must lie in [0, {self.num_heads}); got {head}")
        for key, value in self.extra_heads[head - 1].state_dict().items():
            state[f"{self.head_name}.{key}"] = value
        return state

    @staticmethod
    def user_key(key: str) -> str:
        """``key`` as the user's model names it (``module.fc3.weight`` -> ``fc3.weight``); the
        extra heads' keys (``extra_heads.<i>.*``) have no name in the user's model and stay."""
        return key[len(_MODULE):] if key.startswith(_MODULE) else key

    # ---------------------------------------------------------------- checks
    def _head_module(self, purpose: str) -> nn.Module:
        if self.head_name is None:
            raise ConfigError(
                f"{purpose} needs the model's head as one module; {type(self.module).__name__}'s head "
                f"is {self._head_text}. Name one module as its head (head='<name>'; modules: "
                f"{_listing(module_names(self.module))})"
            )
        return self.module.get_submodule(self.head_name)

    def _unknown_width(self, name: str, side: str) -> str:
        return (
            f"the {side} width of {type(self.module).__name__}'s head ({self._head_text}) is unknown: "
            f"it has no nn.Linear to read it from; give split_model(..., {name}=...)"
        )

    def _never_called(self) -> str:
        return (
            f"{type(self.module).__name__}.forward never called its head {self.head_name!r}; "
            "features() are what forward feeds the head, so the head must be a module that forward calls"
        )

    def _check_head_is_last(self, head: nn.Module, x: torch.Tensor) -> None:
        """One forward pass in eval mode (no side effects on statistics or random state): the head
        runs exactly once and its output is the model's output, so that
        ``head_outputs(features(x))`` is ``model(x)``."""
        outputs: list = []
        handle = head.register_forward_hook(lambda module, args, out: outputs.append(out))
        modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        try:
            with torch.no_grad():
                result = self.module(x)
        finally:
            handle.remove()
            for m, training in modes:
                m.training = training
        kind = type(self.module).__name__
        if not outputs:
            raise ConfigError(self._never_called())
        if len(outputs) > 1:
            raise ConfigError(
                f"{kind}.forward calls its head {self.head_name!r} {len(outputs)} times; features() "
                "and head_outputs() need it called once"
            )
        if outputs[0] is not result:
            raise ConfigError(
                f"{kind}.forward returns something computed after its head {self.head_name!r} (e.g. a "
                "softmax or a reshape); features() and head_outputs() need the head's output to be "
                "the model's output, so that head_outputs(features(x)) equals model(x): make the head "
                "the last step of forward (a softmax belongs in the loss) or name the last module"
            )
        self._checked = True

    def _checked_features(self, inputs: tuple) -> torch.Tensor:
        if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
            raise ConfigError(
                f"the head {self.head_name!r} is called with {len(inputs)} argument(s); features() "
                "need it called with one tensor"
            )
        z = inputs[0]
        width = self._feature_dim
        if z.dim() != 2 or (width is not None and z.shape[1] != width):
            expected = f"(batch, {width})" if width is not None else "(batch, feature_dim)"
            raise ConfigError(
                f"features() must have shape {expected}, but {type(self.module).__name__}'s head "
                f"{self.head_name!r} receives a tensor of shape {tuple(z.shape)}; name a head that "
                "takes flat features (e.g. the final nn.Linear), or give split_model(..., feature_dim=...)"
            )
        return z


def user_keys(model: nn.Module, keys: Sequence[str]) -> list[str]:
    """``keys`` (``model.state_dict`` keys) as the user's own model names them: the same keys
    unless ``model`` wraps the user's model in a :class:`HeadSplit`."""
    return [HeadSplit.user_key(k) for k in keys] if isinstance(model, HeadSplit) else list(keys)


def is_split(model: nn.Module) -> bool:
    """Whether ``model`` already has the body/head interface (EncoderHeadModel, HeadSplit)."""
    return isinstance(model, (EncoderHeadModel, HeadSplit))


def split_model(
    model: nn.Module,
    head: HeadSpec | None = None,
    *,
    num_heads: int = 1,
    feature_dim: int | None = None,
    num_outputs: int | None = None,
) -> HeadSplit:
    """The user's ``model`` with its ``head`` named: a :class:`HeadSplit` (see there for every
    argument). ``split_model(net, "fc3", num_heads=M)`` gives FedDAR its M heads (copies of the
    user's head)."""
    return HeadSplit(model, head, num_heads=num_heads, feature_dim=feature_dim, num_outputs=num_outputs)


def client_model(model: nn.Module, head: HeadSpec | None = None, num_heads: int = 1) -> nn.Module:
    """The model a client trains: an already split model as it is; otherwise
    ``split_model(model, head, num_heads=num_heads)`` (``num_heads`` applies only with a head)."""
    if is_split(model) and head is None:
        return model
    return split_model(model, head, num_heads=num_heads if head is not None else 1)


def check_head(model: nn.Module, requirement: HeadRequirement, algorithm: str) -> None:
    """Refuse a model that lacks what ``algorithm`` needs of its head, saying how to name it.

    Raises:
        ConfigError: ``parameters``: no parameter is in a head; ``module``: the head is not one
            module (no ``features()`` / ``head_outputs()``).
    """
    if requirement == "none":
        return
    in_head = getattr(model, "in_head", None)
    user = model.module if isinstance(model, HeadSplit) else model
    modules = _listing(module_names(user))
    if in_head is None or not any(in_head(k) for k in model.state_dict()):
        raise ConfigError(
            f"{algorithm} needs to know which part of the model is its head; none was named. Pass "
            f"head= to the client: the name of the head module (one of {type(user).__name__}'s "
            f"modules: {modules}), a list of parameter-name prefixes, or a predicate on parameter "
            "names (or hand it a model from flwr_pfl.models.split_model(model, head=...))"
        )
    if requirement == "module" and not getattr(model, "splits_features", False):
        text = model._head_text if isinstance(model, HeadSplit) else "not one module"
        raise ConfigError(
            f"{algorithm} needs the model's head as one module (it uses features() and "
            f"head_outputs()); the head {text} is not one module of {type(user).__name__}. Name "
            f"the head module instead (head='<name>'; modules: {modules})"
        )
