import sys

from .config import parse_config
from .launcher import launch

sys.exit(launch(parse_config()))
