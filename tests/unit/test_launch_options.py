"""The launch options are listed once (sgpu_magic.front.options.LAUNCH_OPTIONS): every front door takes exactly the
options the list says it takes, the job magics' flags are made from it, and each option's %config trait exists.
(stuck_after_s was a trait the decorator and run_script did not take: this test would have failed on it.)"""

from __future__ import annotations

import inspect

import pytest

from sgpu_magic.front.options import (
    DECORATOR,
    LAUNCH_OPTIONS,
    MAGIC,
    SCRIPT,
    SESSION,
    LaunchOption,
    job_options,
    options_of,
)


def _parameters(fn, leave_out=()) -> set[str]:
    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is not p.VAR_KEYWORD and name not in {"self", *leave_out}
    }


def test_each_option_is_listed_once():
    names = [option.name for option in LAUNCH_OPTIONS]
    assert len(names) == len(set(names)), names
    flags = [flag for option in LAUNCH_OPTIONS for flag in option.flags]
    assert len(flags) == len(set(flags)), flags


@pytest.mark.parametrize(
    ("door", "leave_out"),
    [
        (DECORATOR, ()),
        (SCRIPT, ("path_or_module", "args", "module")),  # what to run, not how
        (SESSION, ()),
    ],
)
def test_every_front_door_takes_the_options_the_list_gives_it(door, leave_out):
    from sgpu_magic import Session, distributed, run_script

    fn = {DECORATOR: distributed, SCRIPT: run_script, SESSION: Session.__init__}[door]
    listed = {option.name for option in options_of(door)}
    taken = _parameters(fn, leave_out)
    assert taken == listed, (
        f"{door}: takes but not listed {sorted(taken - listed)}; listed, not taken {sorted(listed - taken)}"
    )


def test_the_job_magics_flags_are_the_lists_and_in_its_order():
    from IPython.core.magic_arguments import magic_arguments

    @magic_arguments()
    @job_options
    def magic(line):
        """A job magic."""

    actions = magic.parser._actions  # magic_arguments adds no -h
    assert [tuple(a.option_strings) for a in actions] == [o.flags for o in options_of(MAGIC) if o.flags]
    assert all(a.help for a in actions)


def test_every_options_config_trait_exists_on_the_magics():
    from sgpu_magic.front.magics import DistributedMagics

    traits = DistributedMagics.class_trait_names(config=True)
    missing = [o.trait for o in LAUNCH_OPTIONS if o.trait is not None and o.trait not in traits]
    assert missing == []


def test_an_option_flag_becomes_one_argparse_argument():
    option = LaunchOption("x", frozenset({MAGIC}), ("--x",), "An x.", {"type": int, "default": 3})

    def magic(line):
        """m"""

    from IPython.core.magic_arguments import magic_arguments, parse_argstring

    decorated = magic_arguments()(option.magic_argument()(magic))
    assert parse_argstring(decorated, "--x 7").x == 7 and parse_argstring(decorated, "").x == 3
