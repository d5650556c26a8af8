#!/usr/bin/env bash
# Builds a LOCAL, signed, flat apt repository that stands in for NVIDIA's CUDA repository in Molecule tests
# (NVIDIA's repository is not reachable from CI). The packages are dummies with the SAME NAMES and version
# strings as NVIDIA's (driver branch 570 and three 580 releases, nvlsm, cuda-toolkit-13-0), with the same
# relationships that matter for pinning and holding: fabric manager and NSCQ depend on the exact driver
# version, and the 570 and 580 branches conflict. Each package has a NEWER version than the one the scenarios
# pin (580.126.09, nvlsm 2026.01.2, cuda 13.0.3), so a missing pin or hold shows up as an upgrade. They carry no kernel modules and no GPU code: services
# are `sleep infinity`, nvcc is a script, libcudart is an empty ELF shared object (so ldconfig indexes it).
#
#   molecule/_aptrepo/build.sh OUTDIR
#     OUTDIR/repo/         flat repository (Packages, Release, InRelease, Release.gpg, *.deb, key.asc)
#     OUTDIR/gnupg/        throwaway GPG home (key generated here, never leaves OUTDIR)
# molecule/_aptrepo/serve.yml (imported by the scenarios' prepare.yml) builds it and serves it to the test hosts.
# Idempotent: rebuilds only when OUTDIR/repo/InRelease is missing or this script is newer.
set -euo pipefail
out=${1:?usage: build.sh OUTDIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -s "$out/repo/InRelease" ] && [ "$out/repo/InRelease" -nt "$here/build.sh" ]; then
  echo "aptrepo: $out/repo is up to date"
  exit 0
fi
for tool in dpkg-deb apt-ftparchive gpg gcc; do
  command -v "$tool" >/dev/null || { echo "aptrepo: $tool is missing (apt-get install dpkg-dev apt-utils gnupg gcc)" >&2; exit 1; }
done
rm -rf "$out/repo" "$out/gnupg" "$out/build"
mkdir -p "$out/repo" "$out/build"
install -d -m 700 "$out/gnupg"
export GNUPGHOME="$out/gnupg"

# Throwaway signing key, no passphrase, valid one day.
gpg --batch --quiet --pinentry-mode loopback --passphrase '' \
  --quick-generate-key "b300-pd molecule test repo <molecule@invalid>" ed25519 sign 1d
gpg --batch --armor --export > "$out/repo/key.asc"

arch=$(dpkg --print-architecture)

# mkdeb NAME VERSION "Depends" "Conflicts" [file:content ...]
# Files are "path=content" pairs; paths ending in .so* are built as ELF shared objects, bin/ and sbin/ paths
# get mode 0755.
mkdeb() {
  local name=$1 version=$2 depends=$3 conflicts=$4
  shift 4
  local root="$out/build/${name}_${version}"
  rm -rf "$root"
  mkdir -p "$root/DEBIAN" "$root/usr/share/doc/$name"
  {
    echo "Package: $name"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Maintainer: b300-pd molecule <molecule@invalid>"
    [ -n "$depends" ] && echo "Depends: $depends"
    [ -n "$conflicts" ] && { echo "Conflicts: $conflicts"; echo "Replaces: $conflicts"; }
    echo "Section: non-free/libs"
    echo "Priority: optional"
    echo "Description: TEST DUMMY of NVIDIA's $name $version (molecule/_aptrepo)"
    echo " Same name and version as NVIDIA's package, no real content. Never install outside tests."
  } > "$root/DEBIAN/control"
  echo "$version" > "$root/usr/share/doc/$name/DUMMY-VERSION"
  local spec path content
  for spec in "$@"; do
    path=${spec%%=*}
    content=${spec#*=}
    mkdir -p "$root/$(dirname "$path")"
    case "$path" in
      *.so*)
        printf 'int b300pd_dummy_%s(void) { return 0; }\n' "$(echo "$name" | tr -c 'a-z0-9\n' _)" > "$out/build/lib.c"
        gcc -shared -fPIC -o "$root/$path" -Wl,-soname,"$(basename "$path" | sed -E 's/(\.so\.[0-9]+).*/\1/')" "$out/build/lib.c"
        ;;
      *) printf '%b' "$content" > "$root/$path" ;;
    esac
    case "$path" in */bin/*|*/sbin/*) chmod 0755 "$root/$path" ;; *) chmod 0644 "$root/$path" ;; esac
  done
  dpkg-deb --root-owner-group -Zxz --build "$root" "$out/repo/${name}_${version}_${arch}.deb" >/dev/null
}

sleeper='#!/bin/sh\n# TEST DUMMY: stands in for the NVIDIA daemon, does nothing.\nexec sleep infinity\n'

# driver_branch BRANCH VERSION OTHER_BRANCH
driver_branch() {
  local b=$1 v=$2 other=$3 rev=1
  mkdeb "nvidia-driver-$b-open" "$v-$rev" "" "nvidia-driver-$other-open" \
    "usr/share/nvidia/driver-branch=$b\n"
  mkdeb "nvidia-fabricmanager-$b" "$v-$rev" "nvidia-driver-$b-open (= $v-$rev)" "nvidia-fabricmanager-$other" \
    "usr/bin/nv-fabricmanager=$sleeper" \
    "lib/systemd/system/nvidia-fabricmanager.service=[Unit]\nDescription=TEST DUMMY FabricManager $v\n[Service]\nType=simple\nExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg\n[Install]\nWantedBy=multi-user.target\n"
  mkdeb "libnvidia-nscq-$b" "$v-$rev" "nvidia-driver-$b-open (= $v-$rev)" "libnvidia-nscq-$other" \
    "usr/lib/$(gcc -print-multiarch)/libnvidia-nscq.so.$v=elf"
}
driver_branch 570 570.195.03 580
driver_branch 580 580.95.05 570
driver_branch 580 580.105.08 570
driver_branch 580 580.126.09 570

for v in 570.195.03 580.95.05 580.105.08 580.126.09; do
  mkdeb nvidia-persistenced "$v-1" "" "" \
    "usr/bin/nvidia-persistenced=$sleeper" \
    "lib/systemd/system/nvidia-persistenced.service=[Unit]\nDescription=TEST DUMMY NVIDIA Persistence Daemon $v\n[Service]\nType=simple\nExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced --no-persistence-mode --verbose\n[Install]\nWantedBy=multi-user.target\n"
done

for v in 2025.06.6 2025.10.4 2026.01.2; do
  mkdeb nvlsm "$v-1" "" "" "usr/bin/nvlsm=$sleeper"
done

for v in 13.0.1 13.0.2 13.0.3; do
  mkdeb cuda-toolkit-13-0 "$v-1" "" "" \
    "usr/local/cuda-13.0/bin/nvcc=#!/bin/sh\n# TEST DUMMY nvcc\necho 'nvcc: NVIDIA (R) Cuda compiler driver (TEST DUMMY)'\necho 'Cuda compilation tools, release 13.0, V$v'\n" \
    "usr/local/cuda-13.0/lib64/libcudart.so.$v=elf" \
    "usr/local/cuda-13.0/version.json={\"cuda\": {\"name\": \"CUDA SDK\", \"version\": \"$v\"}}\n"
done

cd "$out/repo"
apt-ftparchive packages . > Packages
gzip -9nkf Packages
apt-ftparchive -o APT::FTPArchive::Release::Origin="b300-pd molecule" \
  -o APT::FTPArchive::Release::Label="TEST DUMMY CUDA repo" release . > Release
gpg --batch --yes --clearsign -o InRelease Release
gpg --batch --yes -abs -o Release.gpg Release
rm -rf "$out/build"
echo "aptrepo: built $(ls ./*.deb | wc -l) packages in $out/repo, key $out/repo/key.asc"
