"""Real test hosts: systemd-nspawn containers with systemd as PID 1 and sshd, each in its own netns.

  scripts/testhosts up --env NAME [--hosts name=ip[,name=ip...]] [--bind-ro SRC:DST ...] [--timeout S]
  scripts/testhosts down --env NAME | --all
  scripts/testhosts status
  scripts/testhosts ssh --env NAME HOST [-- CMD...]

One Linux bridge per env carries the gateway (.1 of the hosts' /24, the control node); every host gets an
overlayfs root over .cache/testhosts/image (scripts/bootstrap.d/30-testhosts-image), a netns with a veth on
the bridge, its address and a default route via the gateway, and `systemd-nspawn --boot` started detached.
apt inside goes through apt-cacher-ng on the gateway (port 3142); nftables drops everything routed between
an env's bridge and anywhere else, and lets hosts reach the control node on the apt proxy port only.
`--env local` takes its hosts from inventory/local/hosts.yml and its read-only bind mounts and size-limited
volumes (tmpfs) from inventory/local/testhosts.yml. docs/testhosts.md has the details and the troubleshooting.
"""
