from asyncengine.cli import entry

entry()
