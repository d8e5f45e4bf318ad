"""check_reqs.py -- are the Requires-Dist of a bundle's wheels met?

    python3 check_reqs.py lock BUNDLE_DIR WHEEL_DIR IMAGE_PACKAGES   (CPU machine, after prepare.sh)
    python3 check_reqs.py installed PRUNED TARGET...                 (GPU machine, from device_step.sh)

`lock` reads the wheels named in BUNDLE_DIR/lock-*.txt from WHEEL_DIR, checks that each is
installable by CPython 3.12 on manylinux x86_64, and that each requirement (markers evaluated for
Python 3.12 on Linux x86_64, no extras) is met by a locked wheel of a matching version, or else by a
package the GPU image holds (IMAGE_PACKAGES: one name a line, `name==version` where known), or is
listed in BUNDLE_DIR/pruned.txt (`name  reason`: left out on purpose). Exit 1 when one is unmet.

`installed` puts the TARGETs first on sys.path and checks the installed bundle's requirements against
what Python then finds (the bundle, then the image), leaving out the names in PRUNED (the bundle's
pruned.txt; a missing file is fine): informational, it prints and exits 0.
"""
import email.parser
import glob
import os
import re
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.tags import compatible_tags, cpython_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import compatible_tags, cpython_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ENV = {'python_version': '3.12', 'python_full_version': '3.12.3', 'sys_platform': 'linux',
       'platform_system': 'Linux', 'platform_machine': 'x86_64', 'os_name': 'posix',
       'implementation_name': 'cpython', 'platform_python_implementation': 'CPython', 'extra': ''}
PLATFORMS = ([f'manylinux_2_{n}_x86_64' for n in range(39, 4, -1)]
             + ['manylinux2014_x86_64', 'manylinux2010_x86_64', 'manylinux1_x86_64', 'linux_x86_64'])
TAGS = set(cpython_tags((3, 12), abis=['cp312', 'abi3', 'none'], platforms=PLATFORMS)) | \
       set(compatible_tags((3, 12), 'cp312', platforms=PLATFORMS))


def requirements(metadata_text):
    """The Requires-Dist that apply on the GPU machine (no extras)."""
    msg = email.parser.Parser().parsestr(metadata_text)
    for line in msg.get_all('Requires-Dist') or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(ENV):
            yield req


def read_pruned(path):
    """`name  reason` lines -> {canonical name: reason}; {} when the file does not exist."""
    pruned = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip() and not line.startswith('#'):
                name, _, why = line.strip().partition(' ')
                pruned[canonicalize_name(name)] = why.strip()
    return pruned


def check_lock(bundle_dir, wheel_dir, image_file):
    locked = {}   # name -> (version, file)
    for lock in sorted(glob.glob(os.path.join(bundle_dir, 'lock-*.txt'))):
        for line in open(lock):
            m = re.match(r'^([^#\s]\S*)==(\S+) .*# *(\S+\.whl)$', line.strip())
            if m:
                locked[canonicalize_name(m.group(1))] = (m.group(2), m.group(3))
    image = {}
    for line in open(image_file):
        line = line.split('#')[0].strip()
        if line:
            name, _, version = line.partition('==')
            image[canonicalize_name(name)] = version or None
    pruned = read_pruned(os.path.join(bundle_dir, 'pruned.txt'))
    num_unmet, from_image, used_pruned = 0, {}, set()
    for name, (version, filename) in sorted(locked.items()):
        _, _, _, tags = parse_wheel_filename(filename)
        if not tags & TAGS:
            print(f'NOT INSTALLABLE on cp312 manylinux x86_64: {filename}')
            num_unmet += 1
        with zipfile.ZipFile(os.path.join(wheel_dir, filename)) as z:
            meta = next(n for n in z.namelist() if n.endswith('.dist-info/METADATA') and n.count('/') == 1)
            text = z.read(meta).decode()
        for req in requirements(text):
            dep = canonicalize_name(req.name)
            if dep in locked:
                if not req.specifier.contains(locked[dep][0], prereleases=True):
                    print(f'UNMET {name} {version}: {req} (locked {locked[dep][0]})')
                    num_unmet += 1
            elif dep in image:
                have = image[dep]
                if have and not req.specifier.contains(have, prereleases=True):
                    print(f'IMAGE VERSION {name} {version}: {req} (image has {have})')
                from_image.setdefault(dep, []).append(f'{name}: {req}')
            elif dep in pruned:
                used_pruned.add(dep)
            else:
                print(f'UNMET {name} {version}: {req} (neither locked, in the image, nor pruned)')
                num_unmet += 1
    if os.environ.get('IMAGE_REQS_OUT'):   # local_check.sh installs stand-ins for these
        with open(os.environ['IMAGE_REQS_OUT'], 'w') as f:
            f.writelines(f'{d}=={image[d]}\n' if image[d] else f'{d}\n' for d in sorted(from_image))
    print(f'{len(locked)} locked wheels; {len(from_image)} requirements left to the image: '
          + ', '.join(sorted(from_image)))
    print(f'{len(used_pruned)} pruned on purpose: ' + ', '.join(sorted(used_pruned)))
    for dep in sorted(set(pruned) - used_pruned):
        print(f'NOTE pruned.txt names {dep}, which no locked wheel requires')
    print(f'{num_unmet} unmet')
    return 1 if num_unmet else 0


def check_installed(pruned_file, *targets):
    import importlib.metadata as md
    sys.path[:0] = targets
    pruned = read_pruned(pruned_file)
    seen, num_unmet = set(), 0
    for target in targets:
        for info in sorted(glob.glob(os.path.join(target, '*.dist-info'))):
            dist = md.PathDistribution(__import__('pathlib').Path(info))
            name = canonicalize_name(dist.metadata['Name'])
            if name in seen:
                continue
            seen.add(name)
            for req in requirements(dist.read_text('METADATA') or ''):
                if canonicalize_name(req.name) in pruned:
                    continue
                try:
                    have = md.version(req.name)
                except md.PackageNotFoundError:
                    have = None
                if have is None or not req.specifier.contains(have, prereleases=True):
                    print(f'  unmet: {name} {dist.version} requires {req}; found {have or "nothing"}')
                    num_unmet += 1
    print(f'  requirements of {len(seen)} installed distributions: {num_unmet} unmet, '
          f'{len(pruned)} pruned names not checked (the bundle\'s README lists the expected ones)')
    return 0


if __name__ == '__main__':
    mode, args = sys.argv[1], sys.argv[2:]
    sys.exit(check_lock(*args) if mode == 'lock' else check_installed(*args))
