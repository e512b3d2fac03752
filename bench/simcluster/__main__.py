"""``python -m bench.simcluster --num-nodes N --local-size L --rate R [--delay D] -- CMD ...``"""

import sys

from .config import parse_config
from .launcher import launch

sys.exit(launch(parse_config()))
