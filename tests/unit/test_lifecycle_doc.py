"""docs/lifecycle.md's hook tree is the order a real run calls the hooks in.

The tree (and the validation run below it) is parsed from the page: a line with a branch
(``├─``/``└─``) is a node, the lines under it without one continue it; its hooks are the
elements of its ``→`` chains (before the two spaces that start its note) named in `HOOKS`;
``validation`` / ``sanity validation`` stand for the validation run (the sanity run without
the lines marked "not for the sanity run"); ``while ...``/``for each ...`` nodes repeat
their children; a node whose note says ``if``/``unless``/``on log steps`` may be left out.
That makes a pattern, matched against every hook a small `DreamTrainer` run calls (a
`RecordingCallback` overrides them all). The run: 2 epochs of 3 batches, no gradient
accumulation, a log every step, validation every 2 steps (so at the end of epoch 0 and not
of epoch 1), a sanity run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from dream_trainer import HOOKS, DeviceParameters, LoggingParameters, TrainerConfig, TrainingParameters
from dream_trainer.testing import RecordingCallback, ToyTrainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"

EVENT_HOOKS = {"on_train_step_error", "on_checkpoint_saved", "on_checkpoint_loaded", "on_callback_error",
               "on_callback_disabled", "on_interrupt"}
"""Hooks that answer an event, not a place in the loop: the tree does not show them."""

_OPTIONAL = re.compile(r"\bif\b|\bunless\b|on log steps")
_NOT_SANITY = "not for the sanity run"


@dataclass
class Node:
    text: str
    depth: int
    more: list[str] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [self.text, *self.more]

    def items(self) -> list[str]:
        """Its hooks in order, and ``validation``/``sanity validation`` (the validation run)."""
        code = re.split(r"\s{2,}", self.text.strip())[0]
        if code in ("validation", "sanity validation"):
            return [code]
        found = []
        for line in [code, *(re.split(r"\s{2,}", more.strip())[0] for more in self.more)]:
            for element in line.split("→"):
                name = re.match(r"\s*([A-Za-z_]\w*)", element)
                if name and name.group(1) in HOOKS:
                    found.append(name.group(1))
        return found

    def is_loop(self) -> bool:
        return self.text.startswith(("while ", "for each "))

    def is_optional(self) -> bool:
        return bool(_OPTIONAL.search(" ".join(self.lines())))


def _blocks() -> list[list[str]]:
    """The page's ``text`` code blocks, each as its lines up to the first blank one."""
    blocks = re.findall(r"```text\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [block.split("\n\n")[0].splitlines() for block in blocks]


def hook_tree() -> Node:
    """The tree under "Hook order"."""
    lines = _blocks()[0]
    root = Node(lines[0].strip(), 0)
    stack = [root]
    for line in lines[1:]:
        match = re.match(r"^([│ ]*)([├└]─ )?(.*)$", line)
        assert match is not None, line
        prefix, branch, text = match.groups()
        if branch is None:
            stack[-1].more.append(text)
            continue
        node = Node(text, len(prefix) // 4 + 1)
        while stack[-1].depth >= node.depth:
            stack.pop()
        stack[-1].children.append(node)
        stack.append(node)
    return root


def validation_run() -> Node:
    """The validation run's block: indented lines are the body of the ``for each`` above."""
    lines = next(block for block in _blocks() if block[0].strip() == "pre_validation_epoch")
    root = Node("(the validation run)", -1)
    stack = [root]
    for line in lines:
        node = Node(line.strip(), (len(line) - len(line.lstrip())) // 4)
        while stack[-1].depth >= node.depth:
            stack.pop()
        stack[-1].children.append(node)
        stack.append(node)
    return root


def _hooks_of(node: Node) -> set[str]:
    return set(node.items()) | {h for child in node.children for h in _hooks_of(child)}


def _pattern(node: Node, validation: Node, sanity: bool = False) -> str:
    if sanity and _NOT_SANITY in " ".join(node.lines()):
        return ""
    parts = []
    for item in node.items():
        if item in ("validation", "sanity validation"):
            parts.append(_pattern(validation, validation, sanity=item == "sanity validation"))
        else:
            parts.append(re.escape(item) + ";")
    parts += [_pattern(child, validation, sanity) for child in node.children]
    body = "".join(parts)
    if node.is_loop():
        body = f"(?:{body})+"
    if node.is_optional():
        body = f"(?:{body})?"
    return body


class StepCounters(RecordingCallback):
    """Also records ``(global_step, local_batches, batch_idx)`` in each `post_train_step`."""

    def __init__(self) -> None:
        super().__init__()
        self.at_post_train_step: list[tuple[int, int, int]] = []
        self.at_pre_train_step: list[tuple[int, int]] = []

    def pre_train_step(self, batch, batch_idx):
        super().pre_train_step(batch, batch_idx)
        self.at_pre_train_step.append((self.trainer.local_batches, batch_idx))

    def post_train_step(self, result, batch_idx):
        super().post_train_step(result, batch_idx)
        self.at_post_train_step.append((self.trainer.global_step, self.trainer.local_batches, batch_idx))


def _run() -> StepCounters:
    recorder = StepCounters()
    config = TrainerConfig(
        root_dir="runs",
        training_parameters=TrainingParameters(n_epochs=2, num_sanity_val_steps=1, val_every_n_steps=2),
        logging_parameters=LoggingParameters(log_every_n_steps=1),
        device_parameters=DeviceParameters.SINGLE_DEVICE(),
        callbacks=[recorder],
    )
    ToyTrainer(config, n_samples=32, batch_size=8).fit()  # 24 training samples: 3 batches; 1 validation batch
    return recorder


def test_the_hook_tree_of_the_lifecycle_page_is_the_order_a_run_calls_the_hooks_in():
    tree, validation = hook_tree(), validation_run()
    documented = _hooks_of(tree) | _hooks_of(validation)
    assert sorted(set(HOOKS) - EVENT_HOOKS - documented) == []  # every hook of the loop has its place

    recorder = _run()
    recorded = [hook for hook in recorder.hooks if hook not in EVENT_HOOKS]
    assert set(recorded) == set(HOOKS) - EVENT_HOOKS  # the run reaches every place of the tree
    pattern = _pattern(tree, validation)
    assert re.fullmatch(pattern, "".join(f"{hook};" for hook in recorded)), (
        f"docs/lifecycle.md's hook tree does not match the run.\nrecorded: {recorded}\npattern: {pattern}")


def test_post_train_step_sees_local_batches_and_global_step_advanced():
    """As the hook table and the tree say: in `post_train_step` the batch is counted
    (``local_batches == batch_idx + 1``, already from `pre_train_step` on) and, without
    accumulation, the step too (``global_step`` is the step just taken)."""
    recorder = _run()
    assert recorder.at_post_train_step == [(1, 1, 0), (2, 2, 1), (3, 3, 2), (4, 1, 0), (5, 2, 1), (6, 3, 2)]
    assert recorder.at_pre_train_step == [(1, 0), (2, 1), (3, 2), (1, 0), (2, 1), (3, 2)]
    steps = [call.global_step for call in recorder.calls if call.hook == "on_step_begin"]
    assert steps == [0, 1, 2, 3, 4, 5]  # on_step_begin(step) comes before the step is counted


def test_the_pattern_fails_on_a_tree_that_disagrees_with_the_run():
    """Not vacuous: the same recording does not match a tree where `on_step_end` comes
    before `post_train_step`, nor one that leaves `on_step_begin` out."""
    tree, validation = hook_tree(), validation_run()
    recorded = "".join(f"{hook};" for hook in _run().hooks if hook not in EVENT_HOOKS)

    def batch_loop(node: Node) -> Node | None:
        if node.text.startswith("for each batch"):
            return node
        return next((found for child in node.children if (found := batch_loop(child)) is not None), None)

    loop = batch_loop(tree)
    assert loop is not None
    names = [child.items() for child in loop.children]
    post, end = names.index(["post_train_step"]), names.index(["on_step_end"])
    loop.children[post], loop.children[end] = loop.children[end], loop.children[post]
    assert re.fullmatch(_pattern(tree, validation), recorded) is None
    loop.children[post], loop.children[end] = loop.children[end], loop.children[post]
    assert re.fullmatch(_pattern(tree, validation), recorded) is not None
    del loop.children[names.index(["on_step_begin"])]
    assert re.fullmatch(_pattern(tree, validation), recorded) is None
