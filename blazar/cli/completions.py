"""`blazar completions bash|zsh|fish|powershell`: the script to source, on stdout."""

from __future__ import annotations

import os

import asyncclick as click
from asyncclick.shell_completion import (
    CompletionItem,
    ShellComplete,
    add_completion_class,
    get_completion_class,
    split_arg_string,
)

COMPLETE_VAR = "_BLAZAR_COMPLETE"


class PowerShellComplete(ShellComplete):
    """Click ships bash, zsh and fish; PowerShell talks to the same protocol through this class."""

    name = "powershell"
    source_template = r"""Register-ArgumentCompleter -Native -CommandName %(prog_name)s -ScriptBlock {
    param($wordToComplete, $commandAst, $cursorPosition)
    $line = $commandAst.ToString()
    if ($line.Length -lt $cursorPosition) { $line = $line + ' ' }
    $env:COMP_WORDS = $line.Substring(0, [Math]::Min($cursorPosition, $line.Length))
    $env:%(complete_var)s = 'powershell_complete'
    %(prog_name)s | ForEach-Object {
        $value, $help = $_ -split "`t", 2
        [System.Management.Automation.CompletionResult]::new($value, $value, 'ParameterValue',
            $(if ($help) { $help } else { $value }))
    }
    Remove-Item Env:%(complete_var)s, Env:COMP_WORDS
}
"""

    def get_completion_args(self) -> tuple[list[str], str]:
        line = os.environ.get("COMP_WORDS", "")
        words = split_arg_string(line)
        args = words[1:]
        if line.endswith(" ") or not args:
            return args, ""
        return args[:-1], args[-1]

    def format_completion(self, item: CompletionItem) -> str:
        return f"{item.value}\t{item.help or ''}"


add_completion_class(PowerShellComplete)


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish", "powershell"]))
async def completions(shell: str) -> None:
    """Shell completions to stdout: eval "$(blazar completions bash)"."""
    root = click.get_current_context().find_root().command  # the whole `blazar` tree, without importing main
    complete_class = get_completion_class(shell)
    completer = complete_class(root, {}, "blazar", COMPLETE_VAR)
    click.echo(completer.source())
