"""A one-machine cluster of network hosts (namespaces on shaped veth links):
`tandem.testing.netns_cluster`, shared with the tests, run from here as a command.

    sudo python benchmarks/netns_cluster.py --hosts 2 --rate-mbit 200 -- sh -c 'echo $NODE_RANK $HOST_ADDR'
"""

import sys

from tandem.testing.netns_cluster import main

if __name__ == "__main__":
    sys.exit(main())
