from .config import parse_config
from .launcher import launch

raise SystemExit(launch(parse_config()))
