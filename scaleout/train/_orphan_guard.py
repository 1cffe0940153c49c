"""Imported only by the input workers' forkserver (first in ``prefetch._PRELOAD``): the server
dies with the rank that started it (:mod:`scaleout.train.orphans`). Never import it elsewhere: the
import is the action."""

from scaleout.train.orphans import die_with_parent

die_with_parent()
