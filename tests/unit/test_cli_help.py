"""Every fastdeploy-sync subcommand and option has its help (the parser only)."""



def _actions(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield "subcommand " + choice.dest, choice.help
            for sub_name, sub in action.choices.items():
                yield from ((f"{sub_name} {what}", text) for what, text in _actions(sub))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield "option " + "/".join(action.option_strings or [action.dest]), action.help


def test_every_subcommand_and_option_has_help():
    from fastdeploy_sync.cli import build_parser

    parser = build_parser()
    items = list(_actions(parser))
    assert len(items) > 20  # the walk found the subcommands' options
    missing = [what for what, text in items if not text or not text.strip()]
    assert not missing, missing
    subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0]
    for name in ("status", "clean", "keys", "profile", "run"):
        assert subs.choices[name].description, f"{name} has no description"
