"""``python -m bench.simcluster --nodes N --local L --rate R [--delay D] -- CMD ...``"""

import sys

from .config import parse_config
from .launcher import launch

sys.exit(launch(parse_config()))
