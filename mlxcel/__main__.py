from mlxcel.cli.main import main
from mlxcel.process.loop import die_with_parent

if __name__ == "__main__":
    die_with_parent()
    main()
