#!/bin/sh
# An rsh agent that makes network namespaces look like hosts to Open MPI's mpirun
# (`mpirun --mca plm_rsh_agent tools/netns-rsh.sh --host ns0,ns1 ...`): "netns-rsh.sh HOST
# COMMAND..." runs COMMAND, as ssh would, in the network namespace named HOST under HOST as
# its hostname. Used by the multi-machine tests, whose machines are namespaces.
host=$1
shift
exec ip netns exec "$host" unshare --uts sh -c "hostname '$host'; $*"
