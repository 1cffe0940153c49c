"""Config loading: YAML file + ``a.b=c`` overrides -> validated :class:`Config`."""

from scaleout.config.load import format_config, load_config, parse_overrides
from scaleout.config.schema import Config

__all__ = ["Config", "load_config", "parse_overrides", "format_config"]
